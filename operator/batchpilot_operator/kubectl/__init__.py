"""`kubectl batchpilot`: the kubectl plugin (console script ``kubectl-batchpilot``).

Layered bottom-up, each module importing only the ones below it (an import-linter contract in
pyproject.toml holds it):

    main        the argument parser and the dispatch (``kubectl-batchpilot`` runs ``main``)
    commands    promote / abort / retry / pause / resume: the annotations the operator watches
    recommend   ``recommend NAME``: batching settings from the pods' own traffic
    views       ``list``, ``status [-w]`` and ``history``: read and draw
    cluster     the API calls (:class:`Cluster`), :class:`PluginError` and the output (:func:`emit`)
"""
