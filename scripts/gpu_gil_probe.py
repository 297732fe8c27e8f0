"""Whether ``mx.async_eval`` lets other Python threads run while it submits a graph: a thread
counts in a loop while the main thread submits graphs of many small ops (a decode step's
kind of graph), and the count it reaches during each submission is compared with its rate
alone. A share near 1 means the submission released the GIL (the engine's scheduler work
could run beside it).

    python scripts/gpu_gil_probe.py
"""

import tandem.runner  # noqa: F401, I001  (BLAS preload before mlx)
import statistics
import threading
import time

import mlx.core as mx


def main() -> None:
    count, stop = [0], [False]

    def spin() -> None:
        while not stop[0]:
            count[0] += 1

    th = threading.Thread(target=spin, daemon=True)
    th.start()
    time.sleep(0.05)
    c0, t0 = count[0], time.perf_counter()
    time.sleep(0.2)  # (the main thread sleeps: the spinner alone)
    rate = (count[0] - c0) / (time.perf_counter() - t0)
    x = mx.zeros((256, 1024))
    mx.eval(x)
    for ops in (500, 2000):
        shares, ms = [], []
        for _ in range(7):
            y = x
            for _ in range(ops):
                y = y * 1.0001 + 0.5
            c0, t0 = count[0], time.perf_counter()
            mx.async_eval(y)
            dt = time.perf_counter() - t0
            shares.append((count[0] - c0) / (rate * dt))
            ms.append(dt * 1e3)
            mx.eval(y)
        print(
            f"{mx.default_device()} {2 * ops} ops: async_eval {statistics.median(ms):.2f} ms, "
            f"spinner ran {statistics.median(shares):.2f} of its rate alone"
        )
    stop[0] = True
    th.join()


if __name__ == "__main__":
    main()
