//! A TCP relay on loopback that can turn every connection it carries half-open: after
//! [`Relay::freeze`] those connections stay open on both ends and carry nothing more, as when a
//! NAT entry or a proxy in between is lost; connections made after that are relayed again.
//! [`Relay::cut`] closes every connection it carries instead, as a restarted proxy does.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

pub struct Relay {
    /// Where it listens.
    pub address: SocketAddr,
    accepted: Arc<AtomicUsize>,
    /// Bumped at each freeze: connections accepted before it stop carrying.
    frozen: watch::Sender<u64>,
    /// Bumped at each cut: connections accepted before it are closed.
    cuts: watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    /// A relay to `target`, on a free port of the same loopback address.
    pub async fn to(target: SocketAddr) -> Relay {
        let listener = TcpListener::bind((target.ip(), 0)).await.unwrap();
        let address = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let frozen = watch::channel(0).0;
        let cuts = watch::channel(0).0;
        let task = tokio::spawn(relay(
            listener,
            target,
            accepted.clone(),
            frozen.subscribe(),
            cuts.subscribe(),
        ));
        Relay {
            address,
            accepted,
            frozen,
            cuts,
            task,
        }
    }

    /// Every connection open now carries nothing more, and is held open.
    pub fn freeze(&self) {
        self.frozen.send_modify(|generation| *generation += 1);
    }

    /// Every connection open now is closed, on both ends.
    pub fn cut(&self) {
        self.cuts.send_modify(|generation| *generation += 1);
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::Relaxed)
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        // Its connections are tasks of the accepting task's set, aborted with it.
        self.task.abort();
    }
}

async fn relay(
    listener: TcpListener,
    target: SocketAddr,
    accepted: Arc<AtomicUsize>,
    frozen: watch::Receiver<u64>,
    cuts: watch::Receiver<u64>,
) {
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let Ok((mut inbound, _)) = listener.accept().await else {
            continue;
        };
        accepted.fetch_add(1, Ordering::Relaxed);
        let mut frozen = frozen.clone();
        let mut cuts = cuts.clone();
        let born = *frozen.borrow_and_update();
        let born_cut = *cuts.borrow_and_update();
        connections.spawn(async move {
            let Ok(mut outbound) = TcpStream::connect(target).await else {
                return;
            };
            tokio::select! {
                _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => return,
                _ = cuts.wait_for(|generation| *generation > born_cut) => return,
                _ = frozen.wait_for(|generation| *generation > born) => {}
            }
            // Half-open: both ends stay connected, and nothing is read or written.
            std::future::pending::<()>().await;
            drop((inbound, outbound));
        });
        // Finished connections are reaped, so the set holds only live ones.
        while connections.try_join_next().is_some() {}
    }
}
