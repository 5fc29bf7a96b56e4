"""The storage stack: the shard spec (``spec``), schemas, a shard's layout, manifests, and the
read side (``reader``, ``dataset``) and write side (``writer``, ``dataset_writer``) over them.

The read side never imports the write side (``tests/test_architecture.py``).
"""
