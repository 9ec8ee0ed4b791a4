"""``horovod.runner.util.threads.in_thread``, which Horovod's test utilities import: start a
function on a daemon thread. Not part of any collective."""

import threading


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    """Runs ``target(*args)`` on a new thread and returns the thread."""

    def run():
        try:
            target(*args)
        except BaseException:  # noqa: BLE001 - as Horovod's: silent swallows, else re-raise
            if not silent:
                raise

    thread = threading.Thread(target=run, name=name, daemon=daemon)
    thread.start()
    return thread
