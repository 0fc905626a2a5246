"""A trainer rank that does nothing until it is signalled: what ``test_faults_children`` starts
through the ``local`` launcher (torchrun) in place of the real rank module."""

import signal

if __name__ == "__main__":
    while True:
        signal.pause()
