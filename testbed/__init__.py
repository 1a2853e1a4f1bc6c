"""An emulated WAN on one machine: hosts in network namespaces behind shaped links.

Needs root. Imports nothing heavy (no torch): host processes start through ``enter``.

- ``topology``: topology files (hosts, per-pair delay, rate, loss), pure.
- ``vnet``: the virtio-net header TUN frames carry; a frame's size on the wire, pure.
- ``shaping``: FIFOs with a rate and a drop-tail limit, and a packet's path through them, pure.
- ``emulator``: the link emulator process (epoll over every TUN fd, a timer heap).
- ``tun``, ``netns``, ``cgroups``: the kernel objects, one module each.
- ``bed``: ``Testbed``, the context manager that sets it all up and tears it all down.
- ``enter``: runs a command inside one host (its namespace and CPU cgroup).
- ``netcheck``: echo/sink/source tools that measure a path (tests, benchmarks).
- ``cli``: ``fusionllm-testbed`` (check, show, up, clean).
"""
