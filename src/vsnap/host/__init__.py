"""This machine's mechanisms: what vsnap does to the host, below any use case.

    criu/        CRIU's options (the only place its flags are written) and its runner (the only
                 place it runs)
    cuda         the CUDA checkpoint driver API, GPU memory from NVML (pynvml, optional); gpu_early
                 starts the driver early on a thread
    proctree     launching a tree in its own namespaces, identifying and killing its processes;
                 limits: the descriptor limit raised before a tree or CRIU runs
    netns, mounts, shm     namespaces, what is mounted where, each tree's /dev/shm
    trust, paths           who may own what vsnap reads; which directories may be used
    fs           renameat2: the exchange that publishes an image, the no-replace rename of `vsnap rm`
    instances, verified    host records: running instances and captures, files already hashed
    facts        host facts and preflight checks; privileges: the capabilities a capture or a restore
                 needs, and what confines this process (seccomp, masked /proc, AppArmor)
    events, cleanup        phase events and timings; resources released on every exit path

Imports only vsnap.protocol.
"""
