"""Personal data scrubbing: e-mail addresses, IP addresses and phone numbers replaced by placeholders, counted.

Try: ``python -c "from kiln.clean.pii import *; print(PiiScrubber(PiiConfig()).scrub('mail bob@example.org'))"``.
Regexes, as datatrove's PIIFormatter and FineWeb use: a matcher such as phonenumbers' is ~100x slower per MB and
the three patterns below are what web-scale pipelines publish. IP candidates are validated with ``ipaddress``.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from kiln.common.config import check_types

EMAIL = re.compile(
    r"(?<![\w.+-])[A-Za-z0-9][A-Za-z0-9._%+-]{0,63}@(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+[A-Za-z]{2,24}\b"
)
IPV4 = re.compile(r"(?<![\w.])(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(?![\w]|\.\d)")
IPV6 = re.compile(r"(?<![\w:])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}(?![\w:])")
# +CC then groups, or (area) then groups, or ddd-ddd-dddd with one kind of separator; validated to 10-15 digits.
PHONE = re.compile(
    r"(?<![\w+])(?:\+\d{1,3}[ .-]?(?:\(\d{1,4}\)[ .-]?)?\d{1,4}(?:[ .-]\d{2,4}){1,4}"
    r"|\(\d{2,4}\)[ .-]?\d{3,4}[ .-]\d{3,4}"
    r"|\d{3}([.-])\d{3}\1\d{4})(?![\w])"
)


@dataclass
class PiiConfig:
    enabled: bool = True  # replace the personal data below
    emails: bool = True  # e-mail addresses
    ip_addresses: bool = True  # IPv4 and IPv6 addresses (validated)
    phone_numbers: bool = True  # phone numbers of 10-15 digits in international or North-American layouts
    email_placeholder: str = "<EMAIL>"  # text that replaces an e-mail address
    ip_placeholder: str = "<IP_ADDRESS>"  # text that replaces an IP address
    phone_placeholder: str = "<PHONE_NUMBER>"  # text that replaces a phone number

    def __post_init__(self) -> None:
        check_types(self, "clean.pii")


class PiiScrubber:
    """``scrub(text)`` returns (text with placeholders, {"emails": n, "ip_addresses": n, "phone_numbers": n})."""

    def __init__(self, cfg: PiiConfig) -> None:
        self.cfg = cfg

    def _ip(self, m: re.Match, counts: dict[str, int]) -> str:
        s = m.group(0)
        if ":" in s and (s.count(":") < 2 or sum(c.isalnum() for c in s) < 4):
            return s  # times such as 10:30:00 fail validation anyway; '::' alone is no address
        try:
            ipaddress.ip_address(s)
        except ValueError:
            return s
        counts["ip_addresses"] += 1
        return self.cfg.ip_placeholder

    def _phone(self, m: re.Match, counts: dict[str, int]) -> str:
        digits = sum(c.isdigit() for c in m.group(0))
        if not 10 <= digits <= 15:
            return m.group(0)
        counts["phone_numbers"] += 1
        return self.cfg.phone_placeholder

    def scrub(self, text: str) -> tuple[str, dict[str, int]]:
        counts = {"emails": 0, "ip_addresses": 0, "phone_numbers": 0}
        if not self.cfg.enabled:
            return text, counts
        if self.cfg.emails and "@" in text:
            text, counts["emails"] = EMAIL.subn(self.cfg.email_placeholder, text)
        if self.cfg.ip_addresses:
            if "." in text:
                text = IPV4.sub(lambda m: self._ip(m, counts), text)
            if "::" in text or text.count(":") > 6:
                text = IPV6.sub(lambda m: self._ip(m, counts), text)
        if self.cfg.phone_numbers:
            text = PHONE.sub(lambda m: self._phone(m, counts), text)
        return text, counts
