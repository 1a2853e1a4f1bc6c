"""The user's training data: token corpora, their digests, the sample order, ``prepare``.

Imports numpy and the project's ``common`` only (a node that trains nothing still digests its
corpus for the swarm settings, without loading torch); ``prepare`` imports ``tokenizers``
only when given a tokenizer.

- corpus.py:   ``Corpus`` (the stdlib's source bytes, a flat token file or a prepared
               directory), validated and digested on load; ``load_corpus``
- manifest.py: ``Manifest``, the JSON file ``prepare`` writes beside its shards
- sampler.py:  ``Sampler``: which windows a step's micro-batch reads, the held-out split
- prepare.py:  ``prepare``: text and ``.jsonl`` files into token shards and a manifest
"""
