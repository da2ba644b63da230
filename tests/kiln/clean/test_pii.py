"""Tests of kiln/clean/pii.py: PII placeholders and counts."""

from __future__ import annotations

from kiln.clean.pii import PiiConfig, PiiScrubber


def test_pii_placeholders_and_counts() -> None:
    s = PiiScrubber(PiiConfig())
    text = ("Write to jane.doe+news@mail.example.co.uk or call +1 415-555-0132 or (020) 7946 0958; server "
            "192.168.10.12 and 2001:db8::8a2e:370:7334 logged it.")
    out, counts = s.scrub(text)
    assert out == ("Write to <EMAIL> or call <PHONE_NUMBER> or <PHONE_NUMBER>; server <IP_ADDRESS> and "
                   "<IP_ADDRESS> logged it.")
    assert counts == {"emails": 1, "ip_addresses": 2, "phone_numbers": 2}
    safe = "Version 1.2.3 released 2024-01-15 at 10:30:00; 300.1.1.1 is no address; pages 100 200 300; x@y."
    assert s.scrub(safe) == (safe, {"emails": 0, "ip_addresses": 0, "phone_numbers": 0})
    off = PiiScrubber(PiiConfig(emails=False))
    assert off.scrub("a@b.example")[0] == "a@b.example"
