"""hookline.storage.analysis: offline analysis of recorded runs beyond the numpy reader.

Tables (pandas), labelled lazy arrays (xarray on dask) that compute on ``dask.distributed``, and
recorded activations as a torch dataset. Everything here needs the extra
``pip install "hookline[analysis]"`` (or ``[datasets]`` for the Arrow export) and imports it
lazily: ``import hookline.storage`` stays numpy + h5py. ``Field``, ``Handle`` and ``Run`` of
:mod:`hookline.storage.reader` carry thin methods that delegate here.
"""
