"""MindSpore's scheduler process (``MS_ROLE=MS_SCHED``): ``python -m hyperpar_mindspore.scheduler``.

It serves the cluster's rendezvous; MindSpore keeps it inside ``init()`` until the workers have
left. It also exits when the process that started it is gone (``HYPERPAR_MS_PARENT``): a
scheduler must never outlive a failed job.
"""

import os
import threading
import time


def _exit_with_parent(parent: int) -> None:
    while True:
        time.sleep(0.5)
        try:
            os.kill(parent, 0)
        except OSError:
            os._exit(0)


if __name__ == "__main__":
    parent = int(os.environ.get("HYPERPAR_MS_PARENT", "0"))
    if parent:
        threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    import mindspore as ms
    from mindspore.communication import init

    ms.set_device(os.environ.get("HYPERPAR_MS_DEVICE", "CPU"))
    init()
