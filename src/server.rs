//! Running the broker: the gRPC server over a registry, on a listener, until shutdown.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_util::sync::CancellationToken;

use crate::grpc::BrokerService;
use crate::grpc::flagd::{FlagdCore, FlagdService, LegacyService};
use crate::pb::flagd::flag_sync_service_server::FlagSyncServiceServer;
use crate::pb::legacy::flag_sync_service_server::FlagSyncServiceServer as LegacyServer;
use crate::registry::Registry;
use crate::source::Source;

/// How long shutdown waits for watch tasks to stop after the server has.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// A broker serving on a bound listener.
pub struct Running<S> {
    /// The address it listens on.
    pub addr: SocketAddr,
    /// Its registry, for introspection.
    pub registry: Registry<S>,
    /// Cancel to shut it down.
    pub shutdown: CancellationToken,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl<S: Source> Running<S> {
    /// Starts serving `source` on `listener`; watches linger `linger` after their last
    /// subscriber.
    pub fn start(listener: TcpListener, source: S, linger: Duration) -> anyhow::Result<Self> {
        Self::start_with_admin(listener, None, source, linger)
    }

    /// As [`Running::start`], with the admin endpoints on `admin`.
    pub fn start_with_admin(
        listener: TcpListener,
        admin: Option<TcpListener>,
        source: S,
        linger: Duration,
    ) -> anyhow::Result<Self> {
        let addr = listener.local_addr()?;
        let shutdown = CancellationToken::new();
        let registry = Registry::new(source, linger, shutdown.clone());
        if let Some(admin) = admin {
            let shutdown = shutdown.clone();
            tokio::spawn(async move {
                if let Err(error) = crate::admin::serve(admin, shutdown).await {
                    tracing::error!(%error, "the admin server failed");
                }
            });
        }
        let task = tokio::spawn(serve(listener, registry.clone(), shutdown.clone()));
        Ok(Running {
            addr,
            registry,
            shutdown,
            task,
        })
    }

    /// Shuts down and waits for the server to finish.
    pub async fn stop(self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        self.task.await?
    }

    /// Waits for the server to finish (after `shutdown` is cancelled).
    pub async fn finished(self) -> anyhow::Result<()> {
        self.task.await?
    }
}

/// Serves the broker's gRPC services on `listener` until `shutdown` is cancelled, then waits
/// (briefly) for the watch tasks to stop.
pub async fn serve<S: Source>(
    listener: TcpListener,
    registry: Registry<S>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let broker = BrokerService::new(registry.clone(), shutdown.clone());
    let flagd = std::sync::Arc::new(FlagdCore::new(registry.clone(), shutdown.clone()));
    tonic::transport::Server::builder()
        .add_service(broker.server())
        .add_service(FlagSyncServiceServer::new(FlagdService(flagd.clone())))
        .add_service(LegacyServer::new(LegacyService(flagd)))
        .serve_with_incoming_shutdown(
            TcpListenerStream::new(listener),
            shutdown.clone().cancelled_owned(),
        )
        .await?;
    if tokio::time::timeout(STOP_GRACE, registry.stopped())
        .await
        .is_err()
    {
        tracing::warn!(
            tasks = registry.tasks(),
            "watch tasks still running at exit"
        );
    }
    Ok(())
}
