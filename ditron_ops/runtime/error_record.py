"""Layout of the error record: ``int64 [ERR_WORDS]`` in host-readable memory (pinned on CUDA)
that a kernel writes when a bounded wait expires (``language.signals.record_error``) and
``Group.check`` decodes into ``DitronTimeoutError``. ``STATUS`` is written last."""
ERR_STATUS, ERR_OP, ERR_RANK, ERR_PEER, ERR_EPOCH, ERR_KIND = range(6)
ERR_WORDS = 8
KIND_TIMEOUT, KIND_SIZE_MISMATCH = 1, 2
