"""The compose cluster's pager: an Alertmanager webhook receiver that prints each alert as one line.

    python docker/alertmanager/alert_log.py --port 9095        # what the compose service `alert-log` runs
    docker compose logs -f alert-log                           # the pages of a running cluster

Alertmanager (docker/alertmanager/alertmanager.yml) POSTs a JSON notification (webhook format version 4) for each
group of alerts; every alert in it becomes one line on stdout::

    2026-12-01T09:30:05Z FIRING critical DDPRankDown rank=3: Rank 3 is gone; the world of 4 still expects it

Standard library only, so it runs on a bare python image. A body that is not such a notification is answered
400 with one line on stderr, and nothing is printed for it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# Labels every line shows in their own place (or that say nothing: Prometheus' job and instance of the alert).
_SHOWN_APART = {"alertname", "severity", "job", "instance"}


def format_alert(alert: dict, now: datetime.datetime | None = None) -> str:
    """One line for one alert of a notification: time, status, severity, name, the other labels, the summary."""
    labels = alert.get("labels") or {}
    now = now or datetime.datetime.now(datetime.timezone.utc)
    extra = " ".join(f"{k}={v}" for k, v in sorted(labels.items()) if k not in _SHOWN_APART)
    summary = (alert.get("annotations") or {}).get("summary", "")
    head = " ".join(
        part
        for part in (
            now.strftime("%Y-%m-%dT%H:%M:%SZ"),
            str(alert.get("status", "unknown")).upper(),
            labels.get("severity", "-"),
            labels.get("alertname", "?"),
            extra,
        )
        if part
    )
    return f"{head}: {summary}" if summary else head


def alerts_of(body: bytes) -> list[dict]:
    """The alerts of a webhook notification; ValueError naming what is wrong when it is not one."""
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"the body is not JSON ({e})") from None
    alerts = doc.get("alerts") if isinstance(doc, dict) else None
    if not isinstance(alerts, list) or not all(isinstance(a, dict) for a in alerts):
        raise ValueError('no "alerts" list: not an Alertmanager webhook notification')
    return alerts


class AlertLogHandler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - the name http.server dispatches to
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            alerts = alerts_of(body)
        except ValueError as e:
            print(f"alert-log: rejected a POST from {self.client_address[0]}: {e}", file=sys.stderr, flush=True)
            self.send_error(400, str(e))
            return
        for alert in alerts:
            print(format_alert(alert), flush=True)
        self.send_response(200)
        self.end_headers()

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - http.server's signature
        pass  # one line per alert is the whole output; no access log between them


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all, inside its network)")
    parser.add_argument("--port", type=int, default=9095, help="port to listen on (default 9095)")
    args = parser.parse_args(argv)
    try:
        server = ThreadingHTTPServer((args.host, args.port), AlertLogHandler)
    except OSError as e:
        print(f"error: --port {args.port} cannot be opened ({e.strerror}); choose another", file=sys.stderr)
        return 2
    print(f"alert-log: listening on {args.host}:{args.port} for Alertmanager's webhook", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
