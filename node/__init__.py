"""The node: one package per concern; this top level composes them.

- p2p/:       the py-libp2p host and what runs on it: ``Transport`` (tensor frames),
              ``ControlHost`` (gossipsub + bandwidth probes), framing, identity
- control/:   the control plane: ``NodeDaemon`` (heartbeat, probes, plan epochs), agreement,
              bandwidth book, device probe, ``SwarmSettings``, status
- pipeline/:  the stage runtime: ``PipelineRunner`` (1F1B steps over a transport), stage,
              schedule, layout, mailbox, data, ``TrainConfig``, the one-process reference run
              and the launcher run (``fusionllm train``)
- observe/:   watching from outside: ``NodeMetrics`` (``--metrics``) fed by the node's events
              and control's counters, the status page (``fusionllm status --serve``)
- cli/:       the ``fusionllm`` console script
- errors.py:  ``TransportError``, ``DeadlineError``, ``PipelineError``, ... (every concern's)
- local_swarm.py: ``LocalSwarm``: real node processes on one machine (``fusionllm swarm``,
              tests, benchmarks)
- devices.py: ``resolve_device`` (``--device``), for the probe and the stages alike
- children.py: ``JsonChild``: a child process that talks JSON lines, always reaped with its
              process tree (local_swarm, the pipeline launcher, tests, benchmarks)

Imports point one way: cli -> (top level) -> observe -> control, pipeline -> p2p; control and
pipeline never import each other. children.py, devices.py and errors.py import nothing of the node:
any layer may use them.
"""
