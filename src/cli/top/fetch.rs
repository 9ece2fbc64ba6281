//! Reading a broker's admin endpoints into a [`Snapshot`].

use std::time::{Duration, SystemTime};

use anyhow::Context;
use serde_json::Value;

use super::app::{Snapshot, SubscriberRow, WatchRow};

/// `host:port` of an admin address given as a URL or as `host:port`.
pub(super) fn authority(admin: &str) -> anyhow::Result<String> {
    let rest = admin
        .strip_prefix("http://")
        .unwrap_or(admin)
        .trim_end_matches('/');
    anyhow::ensure!(
        !admin.starts_with("https://") && !rest.is_empty() && !rest.contains('/'),
        "--admin {admin}: expected http://host:port or host:port (the admin port is plain HTTP)"
    );
    Ok(rest.to_string())
}

/// A GET on the admin server, with `token` as a bearer token if given; the body of a 200 answer.
async fn get(authority: &str, path: &str, token: Option<&str>) -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let authorization = token
        .map(|t| format!("Authorization: Bearer {}\r\n", t.trim()))
        .unwrap_or_default();
    let read = async {
        let mut stream = tokio::net::TcpStream::connect(authority).await?;
        let request = format!("GET {path} HTTP/1.0\r\nHost: {authority}\r\n{authorization}\r\n");
        stream.write_all(request.as_bytes()).await?;
        let mut response = Vec::new();
        stream
            .take(64 * 1024 * 1024)
            .read_to_end(&mut response)
            .await?;
        Ok::<_, std::io::Error>(response)
    };
    let response = tokio::time::timeout(Duration::from_secs(5), read)
        .await
        .context("no answer within 5 s")??;
    let response = String::from_utf8_lossy(&response);
    let (head, body) = response
        .split_once("\r\n\r\n")
        .context("not an HTTP answer")?;
    let status = head.split(' ').nth(1).unwrap_or_default();
    if status != "200" {
        // The broker says why (a refused caller, a missing token): its first line, bounded.
        let why: String = body
            .lines()
            .next()
            .unwrap_or_default()
            .chars()
            .take(300)
            .collect();
        let hint = match (status, token) {
            ("401" | "403", None) => " (give a token with --token-file)",
            _ => "",
        };
        anyhow::bail!("{path} answered {status}: {why}{hint}");
    }
    Ok(body.to_string())
}

/// Reads a snapshot from the broker at `admin`, sending `token` as a bearer token if given
/// (a broker with `--admin-auth kubernetes` asks callers outside its pod for one).
pub async fn fetch(admin: &str, token: Option<&str>) -> anyhow::Result<Snapshot> {
    let authority = authority(admin)?;
    let (watches, callers, subscribers, metrics) = tokio::try_join!(
        get(&authority, "/debug/watches", token),
        get(&authority, "/debug/callers", token),
        get(&authority, "/debug/subscribers", token),
        get(&authority, "/metrics", token),
    )?;
    let watches: Value = serde_json::from_str(&watches).context("/debug/watches")?;
    let callers: Value = serde_json::from_str(&callers).context("/debug/callers")?;
    let subscribers: Value = serde_json::from_str(&subscribers).context("/debug/subscribers")?;
    let now = SystemTime::now();
    let seconds_since = |v: &Value| {
        v.as_str()
            .and_then(|t| humantime::parse_rfc3339(t).ok())
            .map(|t| now.duration_since(t).unwrap_or_default().as_secs())
    };
    let number = |v: &Value| v.as_u64().unwrap_or_default();
    let watches = watches["watches"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|w| WatchRow {
            selector: w["selector"].as_str().unwrap_or_default().to_string(),
            subscribers: number(&w["subscribers"]),
            rate: None,
            last_event: seconds_since(&w["lastEvent"]),
            errors: number(&w["errors"]),
            stale: number(&w["staleSeconds"]),
            updates: number(&w["updates"]),
        })
        .collect();
    let list = callers["callers"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            (
                c["caller"].as_str().unwrap_or_default().to_string(),
                number(&c["streams"]),
            )
        })
        .collect();
    let mut connections = 0.0;
    let mut sync_streams = 0.0;
    let mut version = String::new();
    for line in metrics.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let value: f64 = value.parse().unwrap_or_default();
        if series.starts_with("crd_broker_connections{") {
            connections += value;
        } else if series == "sync_active_streams" {
            sync_streams = value;
        } else if let Some(labels) = series.strip_prefix("crd_broker_build_info{") {
            version = labels
                .split(',')
                .find_map(|l| l.strip_prefix("version=\""))
                .map(|v| v.trim_end_matches(['"', '}']).to_string())
                .unwrap_or_default();
        }
    }
    let text = |v: &Value| match v {
        Value::String(s) if s.is_empty() => "(absent)".to_string(),
        Value::String(s) => s.clone(),
        _ => "-".to_string(),
    };
    let behind = subscribers["subscribers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|s| s["status"] != "SYNCED")
        .map(|s| {
            let part = s["resources"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|p| p["status"] != "SYNCED")
                .cloned()
                .unwrap_or_default();
            SubscriberRow {
                caller: s["caller"].as_str().unwrap_or_default().to_string(),
                protocol: s["protocol"].as_str().unwrap_or_default().to_string(),
                status: s["status"].as_str().unwrap_or_default().to_string(),
                resource: part["selector"].as_str().unwrap_or_default().to_string(),
                delivered: text(&part["delivered"]),
                current: text(&part["current"]),
            }
        })
        .collect();
    Ok(Snapshot {
        watches,
        callers: list,
        callers_total: number(&callers["total"]),
        connections,
        sync_streams,
        version,
        synced: number(&subscribers["synced"]),
        stale: number(&subscribers["stale"]),
        not_sent: number(&subscribers["notSent"]),
        behind,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admin_addresses_are_urls_or_host_and_port() {
        assert_eq!(
            authority("http://127.0.0.1:8016/").unwrap(),
            "127.0.0.1:8016"
        );
        assert_eq!(authority("[::1]:8016").unwrap(), "[::1]:8016");
        for bad in ["https://b:8016", "http://b:8016/metrics", ""] {
            assert!(authority(bad).is_err(), "{bad}");
        }
    }
}
