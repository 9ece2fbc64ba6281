//! A small DNS server on loopback that answers one name with a set of IPv4 addresses, as a
//! headless Service's name is answered with its ready pods; the set can change while it runs.
//! Enough for c-ares and the Node resolver: A queries (TTL 1 s), an empty answer for other
//! types of the name, NXDOMAIN for other names.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};

/// The DNS server; it stops with the runtime that started it.
pub struct Dns {
    /// Where it answers (UDP).
    pub addr: SocketAddr,
    answers: Arc<Mutex<Vec<Ipv4Addr>>>,
}

impl Dns {
    /// Serves `name` (e.g. `broker.test`) with `ips` on 127.0.0.1 (UDP).
    pub async fn start(name: &str, ips: &[Ipv4Addr]) -> Dns {
        Self::start_on(([127, 0, 0, 1], 0).into(), name, ips).await
    }

    /// As [`Dns::start`], on `at` (port 53 for a `resolv.conf`, which names no port).
    pub async fn start_on(at: SocketAddr, name: &str, ips: &[Ipv4Addr]) -> Dns {
        let socket = tokio::net::UdpSocket::bind(at).await.unwrap();
        let addr = socket.local_addr().unwrap();
        let answers = Arc::new(Mutex::new(ips.to_vec()));
        let served = answers.clone();
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        tokio::spawn(async move {
            let mut buf = [0u8; 1500];
            while let Ok((n, from)) = socket.recv_from(&mut buf).await {
                let ips = served.lock().unwrap().clone();
                if let Some(reply) = answer(&buf[..n], &name, &ips) {
                    let _ = socket.send_to(&reply, from).await;
                }
            }
        });
        Dns { addr, answers }
    }

    /// From now on, answers with `ips`.
    pub fn set(&self, ips: &[Ipv4Addr]) {
        *self.answers.lock().unwrap() = ips.to_vec();
    }
}

/// The reply to one query, or `None` for what is not a query.
fn answer(query: &[u8], name: &str, ips: &[Ipv4Addr]) -> Option<Vec<u8>> {
    if query.len() < 12 || query[2] & 0x80 != 0 {
        return None;
    }
    // The first question: labels, then type and class.
    let mut at = 12;
    let mut labels = Vec::new();
    loop {
        let len = *query.get(at)? as usize;
        at += 1;
        if len == 0 {
            break;
        }
        labels.push(String::from_utf8_lossy(query.get(at..at + len)?).to_ascii_lowercase());
        at += len;
    }
    let qtype = u16::from_be_bytes([*query.get(at)?, *query.get(at + 1)?]);
    let question = &query[12..at + 4];
    let ours = labels.join(".") == name;
    let records: &[Ipv4Addr] = if ours && qtype == 1 { ips } else { &[] };
    let mut reply = Vec::with_capacity(64 + records.len() * 16);
    reply.extend_from_slice(&query[0..2]);
    // QR, the opcode and RD as asked, AA; RA; NOERROR or NXDOMAIN.
    reply.push(0x80 | (query[2] & 0x79) | 0x04);
    reply.push(0x80 | if ours { 0 } else { 3 });
    reply.extend_from_slice(&1u16.to_be_bytes());
    reply.extend_from_slice(&(records.len() as u16).to_be_bytes());
    reply.extend_from_slice(&[0, 0, 0, 0]);
    reply.extend_from_slice(question);
    for ip in records {
        reply.extend_from_slice(&[0xc0, 12]); // the name: a pointer to the question's
        reply.extend_from_slice(&[0, 1, 0, 1]); // A, IN
        reply.extend_from_slice(&1u32.to_be_bytes()); // TTL
        reply.extend_from_slice(&4u16.to_be_bytes());
        reply.extend_from_slice(&ip.octets());
    }
    Some(reply)
}
