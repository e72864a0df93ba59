"""The machinery behind the entry scripts (main.py, loading.py, visualize.py, speed.py).

The four variants and the optimizer fix live in ``utils.py`` and the memory tracker in
``measure.py``, at the top, where users look for them. Here, one concern per module:

- ``names``: run names, file keys and units (no torch import: the plots use it too)
- ``cli``: one-line errors, the parser, device and output-directory checks, JSON writing
- ``model``, ``data``: built-in model shapes and model building; the built-in text and batches
- ``session``: the set-up every entry script shares (launcher, device, config, store, interrupts)
- ``isolation``: running a piece of work in fresh processes on every rank, failures and aborts;
  ``starting``: how those processes start (no torch import: the entry scripts use it first)
- ``child``: what every such process does (trace memory, work, write once, report)
- ``runner``: training one variant; ``simulation``: one rank of N alone (``--simulate_world_size``)
- ``memory_model``: bytes held, counted and predicted; ``report``: summary.json and the console table
- ``loading``: the checkpoint-loading modes; ``plots``: the figures
"""
