"""The controller's loop, in controller-runtime's shape: watch-fed caches (:mod:`.cache`), a
per-policy work queue with requeues (:mod:`.workqueue`) and Lease leader election
(:mod:`.leader`). ``handlers.py`` wires them into kopf; the decision stays in ``planner``."""
