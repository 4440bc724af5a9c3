"""Running Sluice as a service: memory, systemd, logs, metrics, the status page's samples.

`watchdog.py` reads GPU and host memory and engine stats on its own thread and
feeds admission; `sdnotify.py` tells systemd READY, STOPPING, STATUS and
WATCHDOG; `logs.py` sets up one line per event (JSON by default); `metrics.py` is
/metrics; `ignored_log.py` logs once and counts the fields clients sent that were
accepted and ignored; `status_samples.py` keeps the status page's 15 minutes of
samples, which server/http/status_page.py serves with the page.

The app's state (server/state.py) holds this room's metrics, watchdog,
notifier and samples, so it stands above them: nothing here reads an app key,
the shell or an API.
"""
