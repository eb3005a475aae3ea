// Screenshots of one MLflow run page for docs/mlflow.md: model metrics, overview, the summary page.
// Needs the system chromium and the npm package playwright-core; see tools/mlflow_screenshots.md.
// usage: node tools/mlflow_screenshots.js BASE_URL EXPERIMENT_ID RUN_ID OUT_DIR
const { chromium } = require('playwright-core');
const fs = require('fs');
const os = require('os');
const path = require('path');

async function closeAssistant(page) {
  // (MLflow 3 opens an assistant side panel that would cover the page)
  const panel = page.getByText('MLflow Assistant', { exact: false });
  if (await panel.count()) {
    const close = page.locator('button[aria-label*="lose"]').last();
    if (await close.count()) await close.click().catch(() => {});
  }
}

async function shot(page, url, waitFor, file, before) {
  await page.goto(url, { waitUntil: 'load', timeout: 90000 });
  await page.getByText(waitFor, { exact: true }).first().waitFor({ timeout: 60000 });
  await closeAssistant(page);
  if (before) await before(page);
  await page.waitForTimeout(4000); // charts animate in
  await page.screenshot({ path: file });
}

(async () => {
  const [base, exp, run, out] = process.argv.slice(2);
  const profile = fs.mkdtempSync(path.join(os.tmpdir(), 'hookline-shot-'));
  const ctx = await chromium.launchPersistentContext(profile, {
    executablePath: '/usr/bin/chromium', headless: true, viewport: { width: 1280, height: 1000 },
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
           '--disable-background-networking', '--disable-component-update', '--disable-sync'],
  });
  const page = ctx.pages()[0] || await ctx.newPage();
  const runUrl = `${base}/#/experiments/${exp}/runs/${run}`;
  try {
    await shot(page, `${runUrl}/model-metrics`, 'grad_out.0.norm', path.join(out, 'mlflow-run-metrics.png'));
    await shot(page, runUrl, 'Tags', path.join(out, 'mlflow-run-overview.png'));
    await shot(page, `${runUrl}/artifacts`, 'hookline', path.join(out, 'mlflow-run-summary.png'), async (p) => {
      await p.getByText('hookline', { exact: true }).first().click();
      await p.getByText('summary.html', { exact: true }).first().click();
      await p.waitForTimeout(3000); // the preview loads the page
    });
  } finally {
    await ctx.close();
    fs.rmSync(profile, { recursive: true, force: true });
  }
})().catch((e) => { console.error(e); process.exit(1); });
