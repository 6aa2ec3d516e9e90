"""Imported once by the forkserver that test ranks fork from (see ``testing.distributed``).

Every rank of every test world needs torch, the training stack and the installed plugins;
importing them here, once per test session, spares each rank seconds of imports. Only imports
and plugin discovery happen: no thread is started and no process group is made, so forking
from this process is safe.
"""

import torch  # noqa: F401
import torch.distributed  # noqa: F401

from mega.core.plugins import get_plugins

try:  # optional dependency: mega-train, whose loop most test worlds run; worlds without it need torch only
    import mega.train.command  # noqa: F401
    import mega.train.launch_run  # noqa: F401
except ImportError:
    pass

get_plugins()  # imports every installed plugin's modules
