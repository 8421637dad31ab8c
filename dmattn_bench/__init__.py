"""dmattn-bench: autotuned, NaN-proof flash dynamic-mask attention."""

from dmattn_bench.api import flash_dmattn_func
from dmattn_bench.dispatch import use_table
from dmattn_bench.space import BwdConfig, FwdConfig
from dmattn_bench.varlen import flash_dmattn_varlen_func
from dmattn_bench.version import __version__

__all__ = ["flash_dmattn_func", "flash_dmattn_varlen_func", "use_table", "FwdConfig", "BwdConfig", "__version__"]
