"""``python -m koboldcpp_horde_chat.demo``: the demo with its default flags."""

import logging

from .command import main

logging.basicConfig()
raise SystemExit(main())
