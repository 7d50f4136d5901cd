"""Suite-wide settings.

Ranks of the multi-process resilience tests start from a forkserver that imported torch once
(``steptune.core.dist.start_context``): a spawned rank spends seconds of CPU importing torch,
and the suite starts a few hundred of them on 2 cores. Torchrun's restart baseline still starts its fresh
ranks with ``spawn``, and ``test_elastic.py`` keeps one job on ``spawn``, the library's default.
"""

import os

from steptune.core.dist import START_METHOD_ENV

os.environ.setdefault(START_METHOD_ENV, "forkserver")
