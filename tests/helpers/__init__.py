"""What test modules share: fakes, hand-built cases, independent reference implementations, run
fixtures built once, fault injection, paths. Nothing here is a test."""
