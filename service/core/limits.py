"""Hard ceilings fixed in code: no setting and no request goes above them. The configured
limits (`service.core.settings.Settings`) are at most these; the API's schemas enforce them."""

from __future__ import annotations

MAX_TEXTS = 256
MAX_TEXT_CHARS = 100_000
MAX_SEGMENTS = 4096  # rows one request's texts may be split into
MAX_BEAM_SIZE = 8
MAX_NEW_TOKENS = 4096
MAX_ATTENTION_INDICES = 256  # layers or heads listed in one /v1/attention request
MAX_DECIMALS = 8
MAX_TIMEOUT_MS = 3_600_000
MAX_TEMPERATURE = 100.0  # sampling: a flatter distribution than this is the uniform one, near enough
MAX_TOP_K = 1_000_000  # sampling: more than any vocabulary here (the vocabulary's size is used)
MAX_SEED = 2**63 - 1  # sampling: a seed fits a signed 64-bit integer, as OpenAI's does
