from .mask import AttentionMask  # noqa: F401
from .diff import DiffAttention  # noqa: F401
from .cog import CogAttention  # noqa: F401
from .dna import DnAAttention  # noqa: F401
from .dna_cross import DnACrossAttention  # noqa: F401
from .cross import StandardCrossAttention  # noqa: F401
