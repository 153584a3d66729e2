//! Where webhooks may be sent: the destination policy.
//!
//! A webhook URL is chosen by whoever creates a prediction, and the server
//! POSTs to it from inside its own network. Without a policy any account
//! could aim the server at what only the server can reach — the cloud
//! metadata service (`169.254.169.254`, `metadata.google.internal`), admin
//! ports on loopback, hosts of the private network — and read or poke
//! them (server-side request forgery). So by default a webhook may only go
//! to a public address:
//!
//! - only `http` and `https`, and no credentials in the URL (they would be
//!   sent on as Basic auth to wherever the URL points);
//! - no IP literal that is not public unicast, in any spelling: the `url`
//!   crate already turns `127.1`, `2130706433`, `0x7f000001` and
//!   `017700000001` into `127.0.0.1`; IPv6 forms that carry an IPv4
//!   address (mapped `::ffff:a.b.c.d`, compatible `::a.b.c.d`, translated
//!   `::ffff:0:a.b.c.d`, NAT64 `64:ff9b::/96`, 6to4 `2002::/16`) are
//!   judged by the address they carry ([`classify`]);
//! - no well-known internal name ([`internal_name`]): `localhost` and
//!   `*.localhost`, `*.local`, `*.localdomain`, `*.internal` (which holds
//!   `metadata.google.internal`), `*.home.arpa`, `*.lan`, `*.home`,
//!   `*.corp`, `*.intranet`, and every single-label name (`http://intranet/`),
//!   which the resolver completes with the server's search domains —
//!   inside names by construction.
//!
//! A public name can still resolve to an inside address, and can change
//! what it resolves to between the check at create time and the delivery
//! (DNS rebinding). So the check is made again at delivery: the webhook
//! client resolves names through [`VettedResolver`], which refuses a name
//! when **any** of its addresses is refused and hands reqwest only the
//! vetted addresses to connect to — the addresses checked are the ones
//! used. reqwest does not call a resolver for IP literals, so
//! [`check_url`] runs again before each send. The client ([`Outbound`])
//! follows no redirects (a redirect could point anywhere; a 3xx is a
//! failed attempt) and uses no proxy from the environment (a proxy would
//! resolve the name itself, after our check). A network whose only way
//! out is a proxy names it in `[predictions] webhook_proxy`: then each
//! name is resolved and vetted right before the send ([`Outbound::check`])
//! and the proxy connects — the one gap being a name whose answer changes
//! between that check and the proxy's own lookup, which the proxy's egress
//! rules close.
//!
//! An `https` webhook is sent over TLS (rustls) and only to a receiver
//! whose certificate verifies: it must chain to a trusted root — the
//! Mozilla roots compiled into Hangar, plus the CAs of `[predictions]
//! webhook_ca_file` when set ([`hangar_redis::tls`] says why that set) —
//! and name the URL's host. The connection goes to the vetted address
//! while the certificate is checked against the host name of the URL
//! (SNI and name check on the original host), so DNS cannot swap in an
//! address the policy refused nor a certificate for another name. A
//! certificate that does not verify fails the attempt (retried with the
//! usual back-off, the reason logged); an `https` webhook is never sent
//! over plain `http`.
//!
//! An operator opens what they mean to with the `[predictions]
//! webhook_allow` list ([`AllowList`]): CIDRs (`10.1.0.0/16`, `::1/128`,
//! or a bare address for just that one) open addresses, and host names
//! (`hooks.example.com`, exactly; `*.hooks.example.com`, any name under
//! it but not itself) open names — a name on the list may resolve to
//! anything, since its DNS is the operator's. Ports are not restricted.
//!
//! Everything but the resolver is sans-IO: parsing, classifying and
//! matching are pure functions.

use std::fmt;
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use hangar_core::FieldError;
use hangar_redis::tls::CaFile;
use ipnet::IpNet;
use url::{Host, Url};

/// Why an address is not a public one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Blocked {
    /// `0.0.0.0`, `::`.
    Unspecified,
    /// `127.0.0.0/8`, `::1`.
    Loopback,
    /// `10/8`, `172.16/12`, `192.168/16`.
    Private,
    /// `169.254/16` (where cloud metadata services live), `fe80::/10`.
    LinkLocal,
    /// `100.64/10`, carrier-grade NAT (Alibaba's metadata is `100.100.100.200`).
    SharedAddressSpace,
    /// `fc00::/7` (AWS's IPv6 metadata is `fd00:ec2::254`).
    UniqueLocal,
    /// `224/4`, `ff00::/8`.
    Multicast,
    /// `255.255.255.255`.
    Broadcast,
    /// `192.0.2/24`, `198.51.100/24`, `203.0.113/24`, `2001:db8::/32`, `3fff::/20`.
    Documentation,
    /// `198.18/15`.
    Benchmarking,
    /// Anything else that is not global unicast: `0/8`, `192.0.0/24`,
    /// `192.88.99/24`, `240/4`, `2001::/23`, `fec0::/10`, IPv6 outside
    /// `2000::/3`.
    Reserved,
}

impl fmt::Display for Blocked {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Blocked::Unspecified => "an unspecified address",
            Blocked::Loopback => "a loopback address",
            Blocked::Private => "a private-network address",
            Blocked::LinkLocal => "a link-local address (cloud metadata services live there)",
            Blocked::SharedAddressSpace => "a shared (carrier-grade NAT) address",
            Blocked::UniqueLocal => "a unique-local IPv6 address",
            Blocked::Multicast => "a multicast address",
            Blocked::Broadcast => "the broadcast address",
            Blocked::Documentation => "a documentation address",
            Blocked::Benchmarking => "a benchmarking address",
            Blocked::Reserved => "a reserved address",
        })
    }
}

/// Why `ip` may not receive webhooks, or `None` for a public unicast
/// address. IPv6 addresses that carry an IPv4 address are judged by it.
pub fn classify(ip: IpAddr) -> Option<Blocked> {
    match ip {
        IpAddr::V4(v4) => classify_v4(v4),
        IpAddr::V6(v6) => classify_v6(v6),
    }
}

fn classify_v4(ip: Ipv4Addr) -> Option<Blocked> {
    use Blocked::*;
    Some(match ip.octets() {
        [0, 0, 0, 0] => Unspecified,
        [0, ..] => Reserved,
        [10, ..] | [192, 168, ..] => Private,
        [172, b, ..] if b & 0xf0 == 16 => Private,
        [100, b, ..] if b & 0xc0 == 64 => SharedAddressSpace,
        [127, ..] => Loopback,
        [169, 254, ..] => LinkLocal,
        [192, 0, 2, _] | [198, 51, 100, _] | [203, 0, 113, _] => Documentation,
        [192, 0, 0, _] | [192, 88, 99, _] => Reserved,
        [198, b, ..] if b & 0xfe == 18 => Benchmarking,
        [224..=239, ..] => Multicast,
        [255, 255, 255, 255] => Broadcast,
        [240..=255, ..] => Reserved,
        _ => return None,
    })
}

/// The IPv4 address an IPv6 address carries, in the forms where it is
/// the real destination.
pub fn embedded_v4(ip: Ipv6Addr) -> Option<Ipv4Addr> {
    let s = ip.segments();
    let low = Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
    match s {
        // Mapped ::ffff:a.b.c.d, translated ::ffff:0:a.b.c.d, compatible ::a.b.c.d.
        [0, 0, 0, 0, 0, 0xffff, _, _] | [0, 0, 0, 0, 0xffff, 0, _, _] | [0, 0, 0, 0, 0, 0, _, _] => Some(low),
        // NAT64, the well-known prefix 64:ff9b::/96.
        [0x64, 0xff9b, 0, 0, 0, 0, _, _] => Some(low),
        // 6to4: 2002:AABB:CCDD::/48.
        [0x2002, a, b, ..] => Some(Ipv4Addr::new((a >> 8) as u8, a as u8, (b >> 8) as u8, b as u8)),
        _ => None,
    }
}

fn classify_v6(ip: Ipv6Addr) -> Option<Blocked> {
    use Blocked::*;
    if ip.is_unspecified() {
        return Some(Unspecified);
    }
    if ip.is_loopback() {
        return Some(Loopback);
    }
    if let Some(v4) = embedded_v4(ip) {
        return classify_v4(v4);
    }
    let s = ip.segments();
    Some(match s[0] {
        0x2001 if s[1] == 0x0db8 => Documentation,
        0x3fff if s[1] & 0xf000 == 0 => Documentation,
        // IETF protocol assignments, Teredo among them.
        0x2001 if s[1] < 0x0200 => Reserved,
        x if x & 0xfe00 == 0xfc00 => UniqueLocal,
        x if x & 0xffc0 == 0xfe80 => LinkLocal,
        x if x & 0xff00 == 0xff00 => Multicast,
        // Global unicast is 2000::/3; the rest is reserved or local.
        x if x & 0xe000 != 0x2000 => Reserved,
        _ => return None,
    })
}

/// Why a host name is an internal one, or `None`. `host` is lowercase,
/// as the `url` crate gives it; a trailing dot is ignored.
pub fn internal_name(host: &str) -> Option<&'static str> {
    const SUFFIXES: [&str; 10] = [
        "localhost",
        "local",
        "localdomain",
        "internal",
        "home.arpa",
        "lan",
        "home",
        "corp",
        "intranet",
        "arpa",
    ];
    let host = host.strip_suffix('.').unwrap_or(host);
    if !host.contains('.') {
        return Some("a single-label name, completed with the server's own search domains");
    }
    SUFFIXES
        .iter()
        .any(|s| host == *s || host.ends_with(&format!(".{s}")))
        .then_some("a name reserved for local or internal networks")
}

/// What an operator opened with `webhook_allow`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllowList {
    nets: Vec<IpNet>,
    /// Exact names, lowercase, without a trailing dot.
    names: Vec<String>,
    /// `*.suffix` entries, stored as `.suffix`.
    suffixes: Vec<String>,
}

impl AllowList {
    /// Parses `webhook_allow` entries: a CIDR (`10.0.0.0/8`, `::1/128`),
    /// a bare IP address (that one address), a host name
    /// (`hooks.example.com`) or `*.` and a name (every name under it).
    /// The error names the entry as `[i]`.
    pub fn parse(entries: &[String]) -> Result<AllowList, FieldError> {
        let mut list = AllowList::default();
        for (i, entry) in entries.iter().enumerate() {
            let bad = |why: &str| FieldError::new(format!("[{i}]"), format!("`{entry}` {why}"));
            let e = entry.trim();
            if let Ok(net) = e.parse::<IpNet>() {
                list.nets.push(net.trunc());
            } else if let Ok(ip) = e.parse::<IpAddr>() {
                list.nets.push(IpNet::from(ip));
            } else if e.contains('/') || e.starts_with('[') {
                return Err(bad("is not a valid CIDR (e.g. `10.0.0.0/8`, `::1/128`)"));
            } else if let Some(suffix) = e.strip_prefix("*.") {
                let name = host_name(suffix).map_err(|why| bad(&why))?;
                list.suffixes.push(format!(".{name}"));
            } else {
                list.names.push(host_name(e).map_err(|why| bad(&why))?);
            }
        }
        Ok(list)
    }

    /// Whether `ip` is in an allowed network (IPv4-mapped IPv6 addresses
    /// count as the IPv4 address they map).
    pub fn allows_ip(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.nets.iter().any(|n| n.contains(&ip))
    }

    /// Whether the host name `host` is allowed by name.
    pub fn allows_name(&self, host: &str) -> bool {
        let host = host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase();
        self.names.contains(&host) || self.suffixes.iter().any(|s| host.ends_with(s.as_str()))
    }

    /// Whether nothing is opened.
    pub fn is_empty(&self) -> bool {
        self.nets.is_empty() && self.names.is_empty() && self.suffixes.is_empty()
    }
}

/// A host name as the `url` crate normalises it (lowercase, punycode),
/// without a trailing dot; an error for what is not a name.
fn host_name(s: &str) -> Result<String, String> {
    let not_a_name = || "is neither a CIDR nor a host name (`hooks.example.com`, `*.example.com`)".to_owned();
    if s.is_empty() || s.contains(|c: char| c.is_whitespace() || "/\\@:?#[]*%".contains(c)) {
        return Err(not_a_name());
    }
    let url = Url::parse(&format!("http://{s}/")).map_err(|_| not_a_name())?;
    match url.host() {
        Some(Host::Domain(d)) if !d.trim_end_matches('.').is_empty() => {
            Ok(d.trim_end_matches('.').to_owned())
        }
        _ => Err(not_a_name()),
    }
}

/// An error and its sources, joined with `: ` (reqwest hides the
/// resolver's reason in its source chain).
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

/// Why a webhook destination is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refused {
    /// Not a URL at all.
    #[error("`{0}` is not a URL")]
    NotAUrl(String),
    /// Not `http` or `https`.
    #[error("the scheme `{0}` is not allowed: use http or https")]
    Scheme(String),
    /// A user name or password in the URL.
    #[error("credentials in the URL are not allowed (they would be sent on as Basic auth)")]
    Credentials,
    /// An address that is not public.
    #[error("{ip} is {why}; webhooks go to public addresses unless the server's webhook_allow opens it")]
    Address {
        /// The address.
        ip: IpAddr,
        /// Why it is refused.
        why: Blocked,
    },
    /// An internal host name.
    #[error("`{host}` is {why}; webhooks go to public names unless the server's webhook_allow opens it")]
    Name {
        /// The name.
        host: String,
        /// Why it is refused.
        why: &'static str,
    },
    /// A name that resolved to an address that is not public.
    #[error("`{host}` resolves to {ip}, {why}; refused unless the server's webhook_allow opens it")]
    Resolved {
        /// The name.
        host: String,
        /// The address.
        ip: IpAddr,
        /// Why it is refused.
        why: Blocked,
    },
    /// A name that resolved to nothing.
    #[error("`{0}` resolves to no address")]
    Unresolved(String),
}

/// Where a URL that passed [`check_url`] points.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Destination {
    /// An IP literal (reqwest connects to it without resolving).
    Ip(IpAddr),
    /// A host name, vetted again after resolution ([`vet_resolved`]).
    Name(String),
}

/// Checks a webhook URL against the policy (see the module doc).
pub fn check_url(url: &str, allow: &AllowList) -> Result<Destination, Refused> {
    let parsed = Url::parse(url).map_err(|_| Refused::NotAUrl(url.to_owned()))?;
    check_parsed(&parsed, allow)
}

/// [`check_url`] of a parsed URL.
pub fn check_parsed(url: &Url, allow: &AllowList) -> Result<Destination, Refused> {
    if !matches!(url.scheme(), "http" | "https") {
        return Err(Refused::Scheme(url.scheme().to_owned()));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(Refused::Credentials);
    }
    let ip = match url.host() {
        None => return Err(Refused::NotAUrl(url.to_string())),
        Some(Host::Domain(host)) => {
            if !allow.allows_name(host) {
                if let Some(why) = internal_name(host) {
                    return Err(Refused::Name { host: host.to_owned(), why });
                }
            }
            return Ok(Destination::Name(host.to_owned()));
        }
        Some(Host::Ipv4(v4)) => IpAddr::V4(v4),
        Some(Host::Ipv6(v6)) => IpAddr::V6(v6),
    };
    check_ip(ip, allow).map_err(|why| Refused::Address { ip, why })?;
    Ok(Destination::Ip(ip))
}

fn check_ip(ip: IpAddr, allow: &AllowList) -> Result<(), Blocked> {
    match classify(ip) {
        Some(why) if !allow.allows_ip(ip) => Err(why),
        _ => Ok(()),
    }
}

/// The addresses `host` resolved to that may be connected to: all of them
/// when the name is allowed by name; otherwise an error as soon as one is
/// refused (a name that resolves inside is refused as a whole, so the
/// connection cannot fall back to its inside address).
pub fn vet_resolved(host: &str, addrs: &[IpAddr], allow: &AllowList) -> Result<Vec<IpAddr>, Refused> {
    if addrs.is_empty() {
        return Err(Refused::Unresolved(host.to_owned()));
    }
    if allow.allows_name(host) {
        return Ok(addrs.to_vec());
    }
    if let Some(why) = internal_name(host) {
        return Err(Refused::Name { host: host.to_owned(), why });
    }
    for &ip in addrs {
        check_ip(ip, allow).map_err(|why| Refused::Resolved { host: host.to_owned(), ip, why })?;
    }
    Ok(addrs.to_vec())
}

/// A name lookup: the addresses of a host name.
pub type Lookup =
    Arc<dyn Fn(String) -> Pin<Box<dyn Future<Output = std::io::Result<Vec<IpAddr>>> + Send>> + Send + Sync>;

/// The system resolver (`getaddrinfo`, through tokio).
pub fn system_lookup() -> Lookup {
    Arc::new(|host: String| {
        Box::pin(
            async move { Ok(tokio::net::lookup_host((host.as_str(), 0)).await?.map(|a| a.ip()).collect()) },
        )
    })
}

/// reqwest's resolver for webhooks: resolves with a [`Lookup`], then
/// [`vet_resolved`]; reqwest connects only to the addresses it returns.
/// The operator's proxy (`webhook_proxy`), the one name it is asked for
/// when there is one, is not vetted: the operator named it.
pub struct VettedResolver {
    allow: Arc<AllowList>,
    lookup: Lookup,
    proxy_host: Option<String>,
}

impl reqwest::dns::Resolve for VettedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let (host, allow, lookup) = (name.as_str().to_owned(), self.allow.clone(), self.lookup.clone());
        let proxy = self.proxy_host.as_deref().is_some_and(|p| p.eq_ignore_ascii_case(&host));
        Box::pin(async move {
            let ips = lookup(host.clone()).await?;
            if proxy {
                let addrs: reqwest::dns::Addrs = Box::new(ips.into_iter().map(|ip| SocketAddr::new(ip, 0)));
                return Ok(addrs);
            }
            let vetted = vet_resolved(&host, &ips, &allow)?;
            let addrs: reqwest::dns::Addrs = Box::new(vetted.into_iter().map(|ip| SocketAddr::new(ip, 0)));
            Ok(addrs)
        })
    }
}

/// What webhooks and procedure sources are sent and fetched with: an HTTP
/// client whose names are resolved through a [`VettedResolver`], that
/// follows no redirects and uses no proxy from the environment, 10 s per
/// request, `https` verified against the Mozilla roots and the CAs of
/// `ca` (see the module doc) — through the operator's proxy when
/// `[predictions] webhook_proxy` names one — and the check every URL
/// passes before a send ([`Outbound::check`]). Cheap to clone.
#[derive(Clone)]
pub struct Outbound {
    http: reqwest::Client,
    allow: Arc<AllowList>,
    lookup: Lookup,
    proxied: bool,
}

impl Outbound {
    /// The client of `allow` and `ca`, through `proxy` if given (an
    /// `http` or `https` URL, checked at load). Fails only when TLS cannot
    /// be set up with those roots.
    pub fn new(
        allow: Arc<AllowList>,
        ca: Option<&CaFile>,
        proxy: Option<&Url>,
    ) -> Result<Self, reqwest::Error> {
        Self::with_lookup(allow, system_lookup(), ca, proxy)
    }

    /// [`Outbound::new`] resolving names with `lookup` (tests give a fake one).
    pub fn with_lookup(
        allow: Arc<AllowList>,
        lookup: Lookup,
        ca: Option<&CaFile>,
        proxy: Option<&Url>,
    ) -> Result<Self, reqwest::Error> {
        let resolver = VettedResolver {
            allow: allow.clone(),
            lookup: lookup.clone(),
            proxy_host: proxy.and_then(Url::host_str).map(str::to_owned),
        };
        let mut builder = reqwest::Client::builder()
            .use_rustls_tls()
            .tls_built_in_webpki_certs(true)
            .dns_resolver(Arc::new(resolver))
            .redirect(reqwest::redirect::Policy::none())
            .timeout(Duration::from_secs(10));
        builder = match proxy {
            Some(p) => builder.proxy(reqwest::Proxy::all(p.as_str())?),
            None => builder.no_proxy(),
        };
        for der in ca.map(CaFile::certificates).unwrap_or_default() {
            builder = builder.add_root_certificate(reqwest::Certificate::from_der(der)?);
        }
        Ok(Outbound { http: builder.build()?, allow, lookup, proxied: proxy.is_some() })
    }

    /// The HTTP client.
    pub fn http(&self) -> &reqwest::Client {
        &self.http
    }

    /// Checks `url` right before a send: the policy ([`check_url`]) and,
    /// through a proxy — which resolves the name itself, so the client's
    /// resolver never sees it — the name resolved here and vetted
    /// ([`vet_resolved`]). The proxy may still get another answer for the
    /// name than this check did (DNS rebinding between the two): its own
    /// egress rules are the last word there.
    pub async fn check(&self, url: &str) -> Result<(), Refused> {
        let Destination::Name(host) = check_url(url, &self.allow)? else { return Ok(()) };
        if !self.proxied {
            // The client's resolver vets the name as it connects.
            return Ok(());
        }
        let ips = (self.lookup)(host.clone()).await.map_err(|_| Refused::Unresolved(host.clone()))?;
        vet_resolved(&host, &ips, &self.allow).map(drop)
    }
}

/// Webhook destinations refused without an allow-list entry: the twenty
/// that issue 17 found accepted (cloud metadata, private ranges, loopback
/// in every spelling, credentials in the URL). The tests of every layer
/// hold each of them to a 400.
pub const REFUSED_BY_DEFAULT: [&str; 20] = [
    "http://169.254.169.254/",
    "http://metadata.google.internal/",
    "http://[fd00:ec2::254]/",
    "http://100.100.100.200/",
    "http://10.0.0.1/",
    "http://172.16.0.1/",
    "http://192.168.1.1/",
    "http://127.1/",
    "http://2130706433/",
    "http://0x7f000001/",
    "http://[::ffff:127.0.0.1]/",
    "http://[::1]/",
    "http://localhost/",
    "http://0.0.0.0/",
    "http://user:pass@host/",
    "http://017700000001/",
    "http://[::ffff:a9fe:a9fe]/latest/meta-data/",
    "http://[64:ff9b::a9fe:a9fe]/",
    "http://foo.localhost:8080/",
    "http://[fe80::1]/",
];

#[cfg(test)]
mod tests {
    use super::*;

    fn allow(entries: &[&str]) -> AllowList {
        AllowList::parse(&entries.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
    }

    #[test]
    fn the_twenty_hostile_urls_are_refused_without_an_allow_entry() {
        let none = AllowList::default();
        for url in REFUSED_BY_DEFAULT {
            assert!(check_url(url, &none).is_err(), "{url} was accepted");
        }
        assert_eq!(check_url("http://user:pass@host/", &none), Err(Refused::Credentials));
        assert_eq!(check_url("https://user@hooks.example.com/", &none), Err(Refused::Credentials));
    }

    #[test]
    fn every_loopback_spelling_is_loopback() {
        let none = AllowList::default();
        for url in [
            "http://127.1/",
            "http://2130706433/",
            "http://0x7f000001/",
            "http://017700000001/",
            "http://127.0.0.1./",
            "http://[::ffff:127.0.0.1]/",
            "http://[::ffff:0:7f00:1]/",
            "http://[::127.0.0.1]/",
            "http://[64:ff9b::127.0.0.1]/",
            "http://[2002:7f00:1::]/",
            "http://[::1]/",
        ] {
            match check_url(url, &none) {
                Err(Refused::Address { why: Blocked::Loopback, .. }) => {}
                other => panic!("{url}: {other:?}"),
            }
        }
    }

    #[test]
    fn public_destinations_pass() {
        let none = AllowList::default();
        for url in [
            "https://hooks.example.com/replicate",
            "http://8.8.8.8:8080/x",
            "http://[2606:4700::1111]/",
            "http://[::ffff:8.8.8.8]/",
            "http://[64:ff9b::808:808]/",
            "http://172.32.0.1/",
            "http://100.128.0.1/",
            "http://example.com./",
        ] {
            assert!(check_url(url, &none).is_ok(), "{url}: {:?}", check_url(url, &none));
        }
    }

    #[test]
    fn classification_of_the_special_ranges() {
        let c = |s: &str| classify(s.parse().unwrap());
        assert_eq!(c("169.254.169.254"), Some(Blocked::LinkLocal));
        assert_eq!(c("100.64.0.1"), Some(Blocked::SharedAddressSpace));
        assert_eq!(c("100.127.255.255"), Some(Blocked::SharedAddressSpace));
        assert_eq!(c("172.31.255.255"), Some(Blocked::Private));
        assert_eq!(c("192.0.2.1"), Some(Blocked::Documentation));
        assert_eq!(c("198.51.100.7"), Some(Blocked::Documentation));
        assert_eq!(c("203.0.113.9"), Some(Blocked::Documentation));
        assert_eq!(c("198.19.0.1"), Some(Blocked::Benchmarking));
        assert_eq!(c("224.0.0.1"), Some(Blocked::Multicast));
        assert_eq!(c("255.255.255.255"), Some(Blocked::Broadcast));
        assert_eq!(c("240.0.0.1"), Some(Blocked::Reserved));
        assert_eq!(c("0.1.2.3"), Some(Blocked::Reserved));
        assert_eq!(c("0.0.0.0"), Some(Blocked::Unspecified));
        assert_eq!(c("::"), Some(Blocked::Unspecified));
        assert_eq!(c("fd00:ec2::254"), Some(Blocked::UniqueLocal));
        assert_eq!(c("fc00::1"), Some(Blocked::UniqueLocal));
        assert_eq!(c("fe80::1"), Some(Blocked::LinkLocal));
        assert_eq!(c("ff02::1"), Some(Blocked::Multicast));
        assert_eq!(c("2001:db8::1"), Some(Blocked::Documentation));
        assert_eq!(c("3fff::1"), Some(Blocked::Documentation));
        assert_eq!(c("2001::1"), Some(Blocked::Reserved));
        assert_eq!(c("64:ff9b:1::1"), Some(Blocked::Reserved));
        assert_eq!(c("::ffff:10.0.0.1"), Some(Blocked::Private));
        assert_eq!(c("64:ff9b::a9fe:a9fe"), Some(Blocked::LinkLocal));
        assert_eq!(c("2002:a00:1::"), Some(Blocked::Private));
        assert_eq!(c("1.1.1.1"), None);
        assert_eq!(c("2606:4700::1111"), None);
    }

    #[test]
    fn internal_names_and_single_labels() {
        for host in [
            "localhost",
            "localhost.",
            "a.localhost",
            "metadata.google.internal",
            "printer.local",
            "box.localdomain",
            "nas.home.arpa",
            "1.0.0.127.in-addr.arpa",
            "intranet",
        ] {
            assert!(internal_name(host).is_some(), "{host}");
        }
        for host in ["example.com", "hooks.example.com", "localhost.example.com", "internal.example.org"] {
            assert_eq!(internal_name(host), None, "{host}");
        }
    }

    #[test]
    fn the_allow_list_opens_exactly_what_it_names() {
        let a = allow(&["127.0.0.0/8", "::1/128", "10.1.2.3", "hooks.internal", "*.corp.example.com"]);
        assert!(check_url("http://127.0.0.1:9/", &a).is_ok());
        assert!(check_url("http://[::ffff:127.0.0.1]/", &a).is_ok(), "mapped counts as the IPv4 address");
        assert!(check_url("http://[::1]/", &a).is_ok());
        assert!(check_url("http://10.1.2.3/", &a).is_ok());
        assert!(check_url("http://10.1.2.4/", &a).is_err());
        assert!(check_url("http://169.254.169.254/", &a).is_err());
        assert!(check_url("http://hooks.internal/", &a).is_ok());
        assert!(check_url("http://HOOKS.internal./", &a).is_ok());
        assert!(check_url("http://other.internal/", &a).is_err());
        assert!(check_url("http://x.corp.example.com/", &a).is_ok());
        // Credentials stay refused whatever the list says.
        assert_eq!(check_url("http://u:p@127.0.0.1/", &a), Err(Refused::Credentials));
        let only_one = allow(&["127.0.0.1/32"]);
        assert!(check_url("http://127.0.0.2/", &only_one).is_err());
        assert!(check_url("http://[::1]/", &only_one).is_err());
    }

    #[test]
    fn bad_allow_entries_are_named() {
        for (entry, bad) in
            [("10.0.0.0/33", true), ("not a host", true), ("*.", true), ("", true), ("ok.example", false)]
        {
            let e = AllowList::parse(&["::1/128".to_string(), entry.to_string()]);
            assert_eq!(e.is_err(), bad, "{entry}: {e:?}");
            if let Err(e) = e {
                assert_eq!(e.field, "[1]");
                assert!(e.message.contains(entry), "{e}");
            }
        }
    }

    #[test]
    fn resolution_is_vetted_as_a_whole() {
        let none = AllowList::default();
        let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
        assert_eq!(vet_resolved("example.com", &[ip("93.184.216.34")], &none), Ok(vec![ip("93.184.216.34")]));
        // One inside address among public ones refuses the name.
        assert!(matches!(
            vet_resolved("rebind.example", &[ip("93.184.216.34"), ip("169.254.169.254")], &none),
            Err(Refused::Resolved { why: Blocked::LinkLocal, .. })
        ));
        assert!(matches!(vet_resolved("x.example", &[], &none), Err(Refused::Unresolved(_))));
        assert!(matches!(vet_resolved("localhost", &[ip("127.0.0.1")], &none), Err(Refused::Name { .. })));
        let nets = allow(&["127.0.0.0/8"]);
        assert!(vet_resolved("loop.example", &[ip("127.0.0.1")], &nets).is_ok());
        let names = allow(&["hooks.example.com"]);
        assert!(vet_resolved("hooks.example.com", &[ip("10.0.0.5")], &names).is_ok());
        assert!(vet_resolved("evil.example.com", &[ip("10.0.0.5")], &names).is_err());
    }

    /// A name that resolves to loopback is refused by the client before
    /// any connection: the listener never sees one.
    #[tokio::test]
    async fn the_client_refuses_a_name_that_resolves_inside() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let lookup: Lookup =
            Arc::new(|_host: String| Box::pin(async { Ok(vec![IpAddr::V4(Ipv4Addr::LOCALHOST)]) }));
        let strict =
            Outbound::with_lookup(Arc::new(AllowList::default()), lookup.clone(), None, None).unwrap();
        let err = strict.http().get(format!("http://rebind.example:{port}/")).send().await.unwrap_err();
        let chain = error_chain(&err);
        assert!(chain.contains("resolves to 127.0.0.1"), "{chain}");
        // The same name, allowed by name, connects.
        let open = Outbound::with_lookup(Arc::new(allow(&["rebind.example"])), lookup, None, None).unwrap();
        let accept = tokio::spawn(async move { listener.accept().await.is_ok() });
        let _ = open
            .http()
            .get(format!("http://rebind.example:{port}/"))
            .timeout(Duration::from_millis(300))
            .send()
            .await;
        assert!(accept.await.unwrap(), "the allowed name was connected to");
    }

    /// Through a proxy the client's resolver never sees the destination's
    /// name: the check resolves and vets it before the send. Without one
    /// the resolver does that as it connects.
    #[tokio::test]
    async fn through_a_proxy_a_name_is_vetted_before_the_send() {
        let lookup: Lookup = Arc::new(|host: String| {
            Box::pin(async move {
                Ok(match host.as_str() {
                    "inside.example.com" => vec![IpAddr::from([10, 0, 0, 5])],
                    _ => vec![IpAddr::from([93, 184, 216, 34])],
                })
            })
        });
        let proxy = Url::parse("http://proxy.corp:3128").unwrap();
        let allow = Arc::new(allow(&[]));
        let proxied = Outbound::with_lookup(allow.clone(), lookup.clone(), None, Some(&proxy)).unwrap();
        assert!(proxied.check("https://hooks.example.com/x").await.is_ok());
        let e = proxied.check("https://inside.example.com/x").await.unwrap_err();
        assert!(matches!(e, Refused::Resolved { .. }), "{e}");
        assert!(proxied.check("http://10.0.0.1/").await.is_err(), "an inside literal, as ever");
        let direct = Outbound::with_lookup(allow, lookup, None, None).unwrap();
        assert!(direct.check("https://inside.example.com/x").await.is_ok(), "left to the resolver");
    }
}
