"""Framework integrations: callbacks that record a Hugging Face ``Trainer`` or a Lightning ``Trainer`` run.

* :mod:`.transformers`: ``HooklineCallback``, a ``transformers.TrainerCallback``
  (``pip install 'hookline[transformers]'``; in a clone: ``pip install -e '.[transformers]'``);
* :mod:`.lightning`: ``HooklineCallback``, a ``lightning.pytorch.Callback``
  (``pip install 'hookline[lightning]'``; in a clone: ``pip install -e '.[lightning]'``);
* :mod:`.session`: what both share: the callback keywords, and one recording session per training
  run (the Recorder, its hooks on the unwrapped model, steps, pauses, closing on success and on
  failure).

Importing this package imports neither framework; each integration module imports its own
framework and raises :class:`~hookline.storage.errors.MissingDependencyError` naming the extra to
install when it is missing.
"""
