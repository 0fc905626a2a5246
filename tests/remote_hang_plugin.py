"""A server-side plugin for crash tests: holds training step 1 until the server is killed.

Loaded with ``tracerl serve --plugin tests.remote_hang_plugin``; it writes the file named by
``TRACERL_TEST_HANG_MARKER`` when the step is held, so the test knows when to kill."""

import os
import time
from pathlib import Path

import tracerl


@tracerl.hookimpl
def tracerl_before_train_step(model, step, groups, config):
    if step == 1:
        Path(os.environ["TRACERL_TEST_HANG_MARKER"]).write_text(f"{model.name} {step}")
        time.sleep(3600)  # the injected fault: a step that stalls until the test kills the server
