"""The node: transport, daemon, command line, hardware/bandwidth probes, planning glue.

- cli.py:  the ``fusionllm`` console script (``version``, ``demo``)
- demo.py: the compression demo the README's main command runs until the daemon exists
"""
