"""python -m vgpu: the `vgpu` command (vgpu.cli)."""

import sys

from vgpu.cli import main

sys.exit(main())
