"""Layout of the error record: ``int64 [ERR_WORDS]`` in host-readable memory (pinned on CUDA)
that a kernel writes when a bounded wait expires (``language.signals.record_error``) and
``Group.check`` decodes into ``DitronTimeoutError``. ``STATUS`` is written last.

``KIND_BAD_INPUT`` (a kernel met an argument value outside its range, e.g. flash_decode's
``kv_lens``): ``PEER`` holds the element's index and ``EPOCH`` its value.

The device claim word beside the record (``Group._error_tensors``) holds the kind of the first
error (0: none). Waits stop early on any kind but ``KIND_BAD_INPUT``: a kernel that met a bad
value goes on with it clamped, and so does the signal protocol (``wait_at_least``)."""
ERR_STATUS, ERR_OP, ERR_RANK, ERR_PEER, ERR_EPOCH, ERR_KIND = range(6)
ERR_WORDS = 8
KIND_TIMEOUT, KIND_SIZE_MISMATCH, KIND_BAD_INPUT = 1, 2, 3
