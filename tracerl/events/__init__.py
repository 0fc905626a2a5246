"""events: plugin hooks and where they are fired. Above ``core``, below every stage that fires
or implements a hook (``tests/test_layout.py`` checks).

- ``hookspecs.py``: every plugin hook, documented (its arguments, when, on which thread).
- ``plugins.py``: the plugin manager (built-ins, enabled loggers, entry points).
- ``lifecycle.py``: where every hook is fired.

Core's data model fires no hooks: it tells its observers that a rollout was entered
(:func:`tracerl.core.context.observe_rollouts`) or that ``Backend.train`` reported a training
event (:func:`tracerl.core.backend.observe_training`); importing this package subscribes
:mod:`.lifecycle` to both (once), and the other stages call :mod:`.lifecycle` directly.
"""

from ..core.backend import observe_training
from ..core.context import observe_rollouts
from .lifecycle import art_train_event, rollout_started

observe_rollouts(rollout_started)
observe_training(art_train_event)
