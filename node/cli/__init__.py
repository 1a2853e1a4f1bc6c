"""The ``fusionllm`` console script: main.py (commands), demo.py (the codec demo)."""
