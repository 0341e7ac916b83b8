//! Ports for the tests that start launchers or ranks themselves.
use std::net::TcpListener;

/// A port no socket holds now, for a rendezvous store that a process the test starts binds a
/// moment later (rank 0 without a supervisor, torchrun's agent, mpirun's rank 0; the engine's
/// spawner binds its own store before its ranks start).
///
/// Chosen at random outside the kernel's range of ephemeral ports
/// (`/proc/sys/net/ipv4/ip_local_port_range`), not by binding port 0: that picks one inside it,
/// where every outgoing connection and gloo listener of the jobs running beside this one take
/// theirs, and one of them could take it before rank 0 binds it (EADDRINUSE).
pub fn free_port() -> u16 {
    let (lo, hi) = ephemeral_ports().unwrap_or((32768, 60999));
    // Ports below the range from 10000 (under it, well-known services), else above it.
    let (start, end) = if lo > 11_000 { (10_000, lo - 1) } else { (hi.saturating_add(1).max(10_000), u16::MAX) };
    if start < end {
        use std::hash::{BuildHasher, Hasher};
        // A random starting point without a dependency: std's hasher keys are random.
        let h = std::collections::hash_map::RandomState::new().build_hasher();
        let span = (end - start) as u64 + 1;
        let first = h.finish() % span;
        for i in 0..span.min(200) {
            let port = start + ((first + i * 7919) % span) as u16;
            if TcpListener::bind(("0.0.0.0", port)).is_ok() {
                return port;
            }
        }
    }
    // No room outside the range (or every port tried is taken): the kernel's choice.
    let listener = TcpListener::bind("0.0.0.0:0").expect("binding a port the kernel picks");
    listener.local_addr().expect("a bound listener's address").port()
}

/// The kernel's range of ephemeral ports, where Linux says it.
fn ephemeral_ports() -> Option<(u16, u16)> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    let mut it = text.split_whitespace().map(|v| v.parse::<u16>().ok());
    Some((it.next()??, it.next()??))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_lie_outside_the_ephemeral_range_and_can_be_bound() {
        let (lo, hi) = ephemeral_ports().expect("Linux names its ephemeral ports");
        let ports: Vec<u16> = (0..20).map(|_| free_port()).collect();
        for &p in &ports {
            assert!(!(lo..=hi).contains(&p), "port {p} is in the ephemeral range {lo}..={hi}");
            TcpListener::bind(("0.0.0.0", p)).unwrap_or_else(|e| panic!("port {p}: {e}"));
        }
        // Random, not one fixed port that two jobs would share.
        assert!(ports.iter().any(|&p| p != ports[0]), "twenty calls gave the same port {}", ports[0]);
    }
}
