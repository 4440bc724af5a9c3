"""Running Sluice as a service: memory, systemd, logs, metrics, the status page.

`watchdog.py` reads GPU and host memory and engine stats on its own thread and
feeds admission; `sdnotify.py` tells systemd READY, STOPPING, STATUS and
WATCHDOG; `logs.py` sets up one line per event (JSON by default); `metrics.py` is
/metrics; `ignored_log.py` logs once and counts the fields clients sent that were
accepted and ignored; `status_samples.py` keeps the status page's 15 minutes of
samples and `status_page.py` serves the page, `static/` (package data) and
/status.json.
"""
