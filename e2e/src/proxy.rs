//! A TCP proxy the test controls, to cut one client's connection to the
//! API server silently (a partition: packets vanish, nothing is refused).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A running proxy to `upstream`.
#[derive(Debug, Clone)]
pub struct Proxy {
    pub port: u16,
    cut: Arc<AtomicBool>,
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `upstream`.
    pub async fn start(upstream: String) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let cut = Arc::new(AtomicBool::new(false));
        let c = cut.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (upstream, cut) = (upstream.clone(), c.clone());
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(&upstream).await {
                        let (cr, cw) = client.into_split();
                        let (sr, sw) = server.into_split();
                        tokio::join!(pump(cr, sw, cut.clone()), pump(sr, cw, cut));
                    }
                });
            }
        });
        Ok(Self { port, cut })
    }

    /// From now on every byte in either direction is dropped; connections
    /// stay open, new ones are accepted and starved too.
    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    cut: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if cut.load(Ordering::SeqCst) {
                    continue; // black hole
                }
                if to.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        }
    }
}

/// A copy of the kubeconfig at `KUBECONFIG` whose server is the proxy.
pub fn proxied_kubeconfig(
    proxy: &Proxy,
    dir: &std::path::Path,
) -> anyhow::Result<std::path::PathBuf> {
    let path = std::env::var("KUBECONFIG")?;
    let text = std::fs::read_to_string(&path)?;
    let server = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("server: "))
        .ok_or_else(|| anyhow::anyhow!("no server in {path}"))?
        .to_owned();
    let proxied = text.replace(&server, &format!("https://127.0.0.1:{}", proxy.port));
    let out = dir.join("kubeconfig-proxied");
    std::fs::write(&out, proxied)?;
    Ok(out)
}

/// host:port of the API server in `KUBECONFIG`.
pub fn apiserver_addr() -> anyhow::Result<String> {
    let text = std::fs::read_to_string(std::env::var("KUBECONFIG")?)?;
    let server = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("server: https://"))
        .ok_or_else(|| anyhow::anyhow!("no https server in KUBECONFIG"))?;
    Ok(server.trim().to_owned())
}
