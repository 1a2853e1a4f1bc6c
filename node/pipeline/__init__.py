"""The stage runtime: one process's part of synchronous 1F1B training steps.

- data.py:          ``TokenDataset`` (batches from a ``fusionllm.data`` corpus), ``BatchConfig``
- train_config.py:  ``TrainConfig`` (one run, JSON round-trip), ``model_config``,
                    ``build_model`` (a preset or a Hugging Face folder), ``build_layout``,
                    ``load_dataset``
- layout.py:        ``PipelineLayout`` (stages, ``LinkSpec`` per cut, tied parameters)
- schedule.py:      ``one_f_one_b``, ``replica_schedule``, ``owner``
- stage.py:         ``StageWorker`` (forward/backward per micro-batch, AdamW, clipping)
- compute.py:       ``Compute`` (device and precision, autocast), ``Staging`` (pinned host
                    buffers per link for device <-> host frames)
- loss_scale.py:    ``LossScale`` (fp16's dynamic loss scale, the same on every stage)
- link_feedback.py: ``GradientFeedback`` (error feedback per gradient link, across loss scales)
- summary.py:       ``Summary`` (a step's norm, losses, vote and overflow flag), ``combine``
- steps.py:         ``StepReport``, ``Sends``
- traffic.py:       ``LinkTraffic``: bytes per link before and after compression, per step
- mailbox.py:       ``Mailbox`` (received frames by key, checked per sender), ``Role``, ``pump``
- runner.py:        ``PipelineRunner`` (one process's steps over a transport), ``Expectations``
- evaluation.py:    ``eval_pass``: validation micro-batches forward through the stages
- exchanges.py:     ``all_reduce_replicas``, ``sum_tied``: the exchanges after a step's schedule
- local_train.py:   ``train_local``, the one-process reference run
- launcher.py:      ``run_swarm``: every stage replica as a process (the launcher reference run)
- stage_main.py:    one stage replica as a launcher's child process (JSON lines)
"""
