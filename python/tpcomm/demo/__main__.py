"""python -m tpcomm.demo: the main job (decode.py)."""

import sys

from tpcomm.demo.decode import main

sys.exit(main())
