from .diff import DiffAttention  # noqa: F401
from .cog import CogAttention  # noqa: F401
from .dna import DnAAttention, DnACrossAttention  # noqa: F401
