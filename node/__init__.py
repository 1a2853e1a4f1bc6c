"""The node: transport, daemon, command line, hardware/bandwidth probes, planning glue.

- cli.py:  the ``fusionllm`` console script (``version``, ``demo``, ``train``, ``node``, ``status``)
- demo.py: the compression demo the README's main command runs until the daemon exists
- transport.py:      ``Transport`` (trio thread + bridge: send/recv/connect/stats/close),
                     ``TransportConfig``, ``TensorSpec``, ``Received``, ``PeerStats``
- framing.py:        ``FrameHeader``, ``FrameKind``, the length-prefixed frame and its read loop
- host.py:           ``new_secure_host`` (py-libp2p, Noise + Yamux only), ``TENSOR_PROTOCOL``
- identity.py:       ``load_or_create_identity``, the Ed25519 key file (mode 0600)
- errors.py:         ``TransportError``, ``DeadlineError``, ``TransportClosedError``,
                     ``IdentityError``
- transport_main.py: a bare transport node as a process (tests, benchmarks)

Training (the stage runtime):

- data.py:          ``TokenDataset`` (stdlib source bytes or a uint16/uint32 token file),
                    ``BatchConfig``, ``DataError``; batches seeded by (seed, step, micro-batch)
- train_config.py:  ``TrainConfig`` (one run, JSON round-trip), ``build_model``,
                    ``build_layout``, ``load_dataset``
- layout.py:        ``PipelineLayout`` (stages, ``LinkSpec`` per cut, tied parameters),
                    ``balanced_cuts``, ``crossing_values``, ``cut_problem``
- schedule.py:      ``one_f_one_b``, ``replica_schedule``, ``replica_micro_batches``, ``owner``
- stage.py:         ``StageWorker`` (forward/backward per micro-batch, AdamW, clipping),
                    ``OptimizerConfig``, ``clip_coefficient``
- local_train.py:   ``train_local``, the one-process reference run
- mailbox.py:       ``Mailbox`` (received frames by key, checked per sender), ``Role``, ``pump``
- pipeline.py:      ``PipelineRunner`` (one process's steps over the transport),
                    ``Expectations`` (what each peer may send), ``StepReport``, ``roles_of``
- pipeline_main.py: one stage replica as a process (stdin/stdout JSON lines)
- swarm_local.py:   ``run_swarm``: every stage replica as a process on 127.0.0.1
- errors.py also:   ``PipelineError``, ``PeerProtocolError``

The control plane (the node daemon):

- daemon.py:          ``NodeDaemon``, ``NodeConfig``: heartbeat, probes, gossip, plan epochs
- swarm_settings.py:  ``SwarmSettings``: what every node of a swarm must share, and its digest
- control_host.py:    ``ControlHost``, ``ControlConfig``: gossipsub + bandwidth/RTT probes on a
                      py-libp2p host in its own thread
- bandwidth.py:       ``BandwidthBook`` (newest sample per link, staleness, estimates),
                      ``BandwidthReport`` (the gossip message), ``choose_probe_targets``
- agreement.py:       leaderless plan choice: ``check_proposal``, ``choose``, epochs
- status.py:          ``gather`` / ``format_status`` behind ``fusionllm status``
- node_processes.py:  ``LocalSwarm``: real node processes on one machine (tests, benchmarks)
"""
