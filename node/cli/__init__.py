"""The ``fusionllm`` console script: main.py (the parser, ``main``), one ``*_cmd.py`` a command,
options.py (the shared run options), demo.py (the codec demo)."""
