"""A process that prints nothing for a minute (a stage in a long, silent step)."""

import time

time.sleep(60)
