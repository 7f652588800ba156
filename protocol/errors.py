"""The single exception raised for untrusted input that fails validation."""


class MalformedPayloadError(ValueError):
    """Bytes or a message from another peer that fail validation.

    `reason` is a short, stable slug (`too_large`, `length_mismatch`, `index_out_of_range`,
    `non_finite`, ...) suitable as a metric label; the message says what exactly was wrong.
    """

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
