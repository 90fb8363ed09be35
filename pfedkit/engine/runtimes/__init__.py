"""The runtimes: who trains a round's Fit requests and evaluates clients, one module each.

    sequential.py   the reference: one client after another in this process
    processes.py    a pool of worker processes (transport.py: its shared-memory plumbing)
    vectorized.py   a step's requests as one batched torch.func computation
    ray.py          Ray actors, on this machine or a cluster
    workers.py      what they share (one trainer/evaluator per architecture, a worker, job order)

Each satisfies `pfedkit.engine.protocols.Runtime`; `pfedkit.build.RUNTIMES` maps a backend name to
its row (the function that builds it, and its default thread count). Nothing is imported here, so
`import pfedkit.engine.runtimes.X` loads X and what it needs only (Ray and torch.func stay unloaded
unless their backend runs).
"""
