from .diff import DiffAttention  # noqa: F401
from .cog import CogAttention  # noqa: F401
