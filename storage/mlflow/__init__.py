"""MLflow integration: register hookline run directories with MLflow runs and read them back.

One module per job:

* :mod:`.keys`: MLflow tag, metric and artifact names of a run directory's contents;
* :mod:`.client`: connecting to a tracking store, the reachability check, run lookup;
* :mod:`.rundir`: what a local run directory holds for an upload (manifests, digests, norms);
* :mod:`.report`: :class:`~.report.SyncReport`, what passes did;
* :mod:`.upload`: one sync pass of a run directory into a run, step by step;
* :mod:`.transfer`: the pass's file uploads, on a few threads, within the time budget;
* :mod:`.adapter`: :class:`~.adapter.MlflowAdapter`, passes on a background thread;
* :mod:`.shutdown`: closing adapters (and recorders) at interpreter exit;
* :mod:`.sync`: :func:`~.sync.sync`, one final pass (``hookline sync``);
* :mod:`.uri`: MLflow run references (``runs:/``, ``mlflow-artifacts:``, bare run ids);
* :mod:`.source`: :class:`~.source.MlflowSource`, the reader's source for a synced run.

``mlflow`` itself is imported lazily, inside functions, so importing this package (or
``hookline.storage``) never imports it. The public names are exported by ``hookline.storage``.
"""
