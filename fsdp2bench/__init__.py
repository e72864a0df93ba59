"""The machinery behind the entry scripts (main.py, plan.py, matrix.py, speed.py, loading.py, visualize.py).

The four variants and the optimizer fix live in ``utils.py`` and the memory tracker in ``measure.py``, at the top,
where users look for them. Here, one wing a concern, in layers: a module imports from its own wing or a lower one
(tests/test_layers.py keeps it so). Bottom to top:

- ``names``, ``cli``, ``files``: run names, file keys and units; the command line (one-line errors, the parser, checks
  of values and devices); the files a run writes (output directories, locks, atomic writes, the mark); none imports
  torch: the plots and the first import use them
- ``options``: what a run is asked to do: ``fsdp`` (the FSDP2 options, the option sets), ``layout`` (R x S x C x T),
  ``step`` (loop and loss), ``levers`` (checkpointing, compile, float8), ``accelerate_config`` (the user's config),
  ``links`` (the cluster's links, a collective's cost by its group's shape)
- ``memory``: ``accounting`` (bytes held, counted and expected), ``estimate`` (a step's peak, calibrated; the GPU
  cap), ``snapshots`` (the tensors alive at a peak)
- ``processes``: ``first`` and ``starting`` (before torch), ``isolation`` (fresh processes on every rank, failures,
  interrupts), ``child`` (what each does), ``simulation`` (one rank of N alone), ``emulation`` (its collectives'
  time), ``torchrun`` (quiet launches)
- ``train``: ``runner`` (one variant trained), ``model``, ``data``, ``weights``, ``throughput``, ``progress``
- ``report``: ``summary`` (summary.json and its checks), ``console`` (what a run says), ``matrix`` (matrix.py's rows),
  ``plots`` (the figures) and ``traces`` (the files they are drawn from)
- ``loading``: ``modes`` (the five loading modes), ``checkpoints``
- ``run``: a launch of main.py: ``arguments``, ``session``, ``suite``, ``concurrency``, ``bare``, ``versions``
- ``plan``: plan.py: ``checks`` (its command line), ``search``, ``report``, ``plot``, ``shared``, ``probes``, ``room``;
  and ``plan.layout`` (the layout search): ``candidates``, ``traffic``, ``search``, ``timing``, ``report``, ``plot``,
  ``run``

Every wing's ``__init__.py`` stays empty: the first imports run before torch, and the fork server pickles
functions by their module path.
"""
