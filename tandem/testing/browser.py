"""Where the browser tests find Chromium: ``TANDEM_CHROMIUM``, else a chromium or chrome on
the PATH (Debian's ``chromium`` package installs /usr/bin/chromium). Playwright's own
browser download is never used: the machines that run the tests cannot fetch it."""

from __future__ import annotations

import os
import shutil

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    path = os.environ.get("TANDEM_CHROMIUM")
    if path:
        return path if os.access(path, os.X_OK) else None
    for name in NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None
