//! Pure: no I/O, no clock; randomness comes from the caller.

use std::collections::BTreeMap;

use mesh_protocol::{NodeId, Provides, Requirement, ResourceKind};
use rand::Rng;

/// What the record told of one module (`inventory.module.placed`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModuleFacts {
    pub nodes: Vec<NodeId>,
    pub requires: Vec<Requirement>,
    pub provides: Vec<Provides>,
}

/// The provider that serves a requirement: its module, what it provides, and
/// the nodes its server runs on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    pub module: String,
    pub provides: Provides,
    pub nodes: Vec<NodeId>,
}

/// One requirement of one module, and who serves it (or, in words, why no
/// provider can yet: the grant waits, and the reason is its condition).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wanted {
    pub consumer: String,
    pub requirement: Requirement,
    pub provider: Result<Choice, String>,
}

/// Every requirement of every module, by consumer then requirement name, with
/// the provider that serves it: the one `provider` names, else the only
/// module (other than the consumer) that provides the kind.
pub fn resolve(modules: &BTreeMap<String, ModuleFacts>) -> Vec<Wanted> {
    let mut out = Vec::new();
    for (consumer, facts) in modules {
        let mut requires = facts.requires.clone();
        requires.sort_by(|a, b| a.name.cmp(&b.name));
        for r in requires {
            let provider = choose(modules, consumer, &r);
            out.push(Wanted {
                consumer: consumer.clone(),
                requirement: r,
                provider,
            });
        }
    }
    out
}

fn choose(
    modules: &BTreeMap<String, ModuleFacts>,
    consumer: &str,
    r: &Requirement,
) -> Result<Choice, String> {
    let offers = |name: &str, m: &ModuleFacts| {
        m.provides
            .iter()
            .find(|p| p.kind == r.kind)
            .map(|p| (name.to_owned(), p.clone(), m.nodes.clone()))
    };
    let (module, provides, nodes) = match &r.provider {
        Some(name) => {
            let m = modules
                .get(name)
                .ok_or_else(|| format!("provider module `{name}` does not exist"))?;
            offers(name, m).ok_or_else(|| format!("module `{name}` does not provide {}", r.kind))?
        }
        None => {
            let mut all: Vec<_> = modules
                .iter()
                .filter(|(name, _)| name.as_str() != consumer)
                .filter_map(|(name, m)| offers(name, m))
                .collect();
            match all.len() {
                0 => return Err(format!("no module provides {}", r.kind)),
                1 => all.remove(0),
                _ => {
                    let names: Vec<String> = all.into_iter().map(|(n, _, _)| n).collect();
                    return Err(format!(
                        "several modules provide {} ({}): name one in `provider`",
                        r.kind,
                        names.join(", ")
                    ));
                }
            }
        }
    };
    if nodes.is_empty() {
        return Err(format!("provider module `{module}` runs on no node yet"));
    }
    Ok(Choice {
        module,
        provides,
        nodes,
    })
}

/// The name a grant's resource (and, but for buckets, its user) takes on the
/// provider's server: `<consumer>-<requirement>`, at most 63 characters (the
/// bucket rules), so two consumers of one provider never collide.
pub fn resource_name(consumer: &str, requirement: &str) -> Result<String, String> {
    let name = format!("{consumer}-{requirement}");
    mesh_protocol::validate_resource_name("name", &name)
        .map(|()| name)
        .map_err(|e| format!("the resource name is unusable: {e}"))
}

/// A grant's credential: the user it logs in as and its secret.
#[derive(Clone, PartialEq, Eq)]
pub struct Credential {
    pub user: String,
    pub password: String,
}

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credential")
            .field("user", &self.user)
            .field("password", &"<redacted>")
            .finish()
    }
}

/// A new credential for a grant of `kind` whose resource is `resource`: a
/// password of 32 random bytes in hex (safe in URLs and every server's
/// syntax); for `s3.bucket` a Garage key (`GK` and 24 hex digits, and a
/// 64-hex-digit secret).
pub fn new_credential(kind: ResourceKind, resource: &str, rng: &mut impl Rng) -> Credential {
    let password = hex::encode(rng.random::<[u8; 32]>());
    let user = match kind {
        ResourceKind::S3Bucket => format!("GK{}", hex::encode(rng.random::<[u8; 12]>())),
        ResourceKind::PostgresDatabase | ResourceKind::AmqpVhost => resource.to_owned(),
    };
    Credential { user, password }
}

/// The credential file of a grant: an env file (`KEY=value` lines) that the
/// consumer's process reads and the provider's agent takes the password from
/// (`ResourceKind::password_key`), with the version it holds
/// (`MESH_CREDENTIAL_VERSION`).
pub fn credential_file(
    kind: ResourceKind,
    provides: &Provides,
    resource: &str,
    credential: &Credential,
    version: i64,
) -> String {
    let (host, port) = (&provides.host, provides.port);
    let (user, pw) = (&credential.user, &credential.password);
    let url_host = if host.contains(':') {
        format!("[{host}]")
    } else {
        host.clone()
    };
    let lines: Vec<(&str, String)> = match kind {
        ResourceKind::PostgresDatabase => vec![
            ("PGHOST", host.clone()),
            ("PGPORT", port.to_string()),
            ("PGDATABASE", resource.to_owned()),
            ("PGUSER", user.clone()),
            ("PGPASSWORD", pw.clone()),
            (
                "DATABASE_URL",
                format!("postgres://{user}:{pw}@{url_host}:{port}/{resource}"),
            ),
        ],
        ResourceKind::AmqpVhost => vec![
            ("AMQP_HOST", host.clone()),
            ("AMQP_PORT", port.to_string()),
            ("AMQP_VHOST", resource.to_owned()),
            ("AMQP_USER", user.clone()),
            ("AMQP_PASSWORD", pw.clone()),
            (
                "AMQP_URL",
                format!(
                    "amqp://{user}:{pw}@{url_host}:{port}/{}",
                    urlencoding::encode(resource)
                ),
            ),
        ],
        ResourceKind::S3Bucket => vec![
            ("AWS_ENDPOINT_URL", format!("http://{url_host}:{port}")),
            ("AWS_REGION", "garage".to_owned()),
            ("AWS_ACCESS_KEY_ID", user.clone()),
            ("AWS_SECRET_ACCESS_KEY", pw.clone()),
            ("S3_BUCKET", resource.to_owned()),
        ],
    };
    let mut out = String::new();
    for (k, v) in lines {
        out.push_str(k);
        out.push('=');
        out.push_str(&v);
        out.push('\n');
    }
    out.push_str(&format!(
        "{}={version}\n",
        mesh_protocol::CREDENTIAL_VERSION_KEY
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use mesh_protocol::{AdminAccess, AdminServer};

    fn node(n: &str) -> NodeId {
        NodeId::parse(n).unwrap()
    }

    fn provides(kind: ResourceKind) -> Provides {
        let server = match kind {
            ResourceKind::PostgresDatabase => AdminServer::Postgres,
            ResourceKind::AmqpVhost => AdminServer::Rabbitmq,
            ResourceKind::S3Bucket => AdminServer::Garage,
        };
        Provides {
            kind,
            host: "10.202.7.2".into(),
            port: 5433,
            admin: AdminAccess {
                server,
                socket_dir: None,
                user: None,
                node: None,
                home: None,
                config: None,
            },
        }
    }

    fn requires(kind: ResourceKind, name: &str, provider: Option<&str>) -> Requirement {
        Requirement {
            kind,
            name: name.into(),
            options: BTreeMap::new(),
            provider: provider.map(str::to_owned),
            delete: false,
        }
    }

    fn fleet() -> BTreeMap<String, ModuleFacts> {
        let mut m = BTreeMap::new();
        m.insert(
            "app".to_owned(),
            ModuleFacts {
                nodes: vec![node("node-a")],
                requires: vec![
                    requires(ResourceKind::S3Bucket, "media", None),
                    requires(ResourceKind::PostgresDatabase, "main", None),
                    requires(ResourceKind::AmqpVhost, "events", Some("mq")),
                ],
                provides: vec![],
            },
        );
        m.insert(
            "pg".to_owned(),
            ModuleFacts {
                nodes: vec![node("node-b")],
                requires: vec![],
                provides: vec![provides(ResourceKind::PostgresDatabase)],
            },
        );
        m
    }

    #[test]
    fn each_requirement_gets_its_provider_or_a_reason() {
        let wanted = resolve(&fleet());
        let by: BTreeMap<&str, &Wanted> = wanted
            .iter()
            .map(|w| (w.requirement.name.as_str(), w))
            .collect();
        assert_eq!(
            by.keys().copied().collect::<Vec<_>>(),
            ["events", "main", "media"]
        );
        let main = by["main"].provider.as_ref().unwrap();
        assert_eq!(main.module, "pg");
        assert_eq!(main.nodes, vec![node("node-b")]);
        assert_eq!(
            by["events"].provider.as_ref().unwrap_err(),
            "provider module `mq` does not exist"
        );
        assert_eq!(
            by["media"].provider.as_ref().unwrap_err(),
            "no module provides s3.bucket"
        );
    }

    #[test]
    fn ambiguity_unplaced_providers_and_wrong_kinds_wait_with_a_reason() {
        let mut f = fleet();
        f.insert(
            "pg2".to_owned(),
            ModuleFacts {
                nodes: vec![],
                requires: vec![],
                provides: vec![provides(ResourceKind::PostgresDatabase)],
            },
        );
        let main = |f: &BTreeMap<String, ModuleFacts>| {
            resolve(f)
                .into_iter()
                .find(|w| w.requirement.name == "main")
                .unwrap()
                .provider
        };
        assert_eq!(
            main(&f).unwrap_err(),
            "several modules provide postgres.database (pg, pg2): name one in `provider`"
        );
        if let Some(app) = f.get_mut("app") {
            app.requires[1].provider = Some("pg2".into());
        }
        assert_eq!(
            main(&f).unwrap_err(),
            "provider module `pg2` runs on no node yet"
        );
        if let Some(app) = f.get_mut("app") {
            app.requires[1].provider = Some("app".into());
        }
        assert_eq!(
            main(&f).unwrap_err(),
            "module `app` does not provide postgres.database"
        );
    }

    #[test]
    fn a_module_never_serves_itself_unless_it_names_itself() {
        let mut f = BTreeMap::new();
        f.insert(
            "pg".to_owned(),
            ModuleFacts {
                nodes: vec![node("node-b")],
                requires: vec![requires(ResourceKind::PostgresDatabase, "own", None)],
                provides: vec![provides(ResourceKind::PostgresDatabase)],
            },
        );
        assert!(resolve(&f)[0].provider.is_err());
        f.get_mut("pg").unwrap().requires[0].provider = Some("pg".into());
        assert_eq!(resolve(&f)[0].provider.as_ref().unwrap().module, "pg");
    }

    #[test]
    fn resource_names_are_bounded() {
        assert_eq!(resource_name("app", "main").unwrap(), "app-main");
        assert!(resource_name(&"a".repeat(48), &"b".repeat(20)).is_err());
    }

    #[test]
    fn credentials_are_random_and_shaped_for_their_server() {
        let mut rng = rand::rng();
        let pg = new_credential(ResourceKind::PostgresDatabase, "app-main", &mut rng);
        assert_eq!(pg.user, "app-main");
        assert_eq!(pg.password.len(), 64);
        assert_ne!(
            pg.password,
            new_credential(ResourceKind::PostgresDatabase, "app-main", &mut rng).password
        );
        let s3 = new_credential(ResourceKind::S3Bucket, "app-media", &mut rng);
        assert!(mesh_protocol::is_garage_key_id(&s3.user), "{}", s3.user);
        assert!(!format!("{pg:?}").contains(&pg.password));
    }

    #[test]
    fn the_credential_file_holds_what_each_side_reads() {
        let c = Credential {
            user: "app-main".into(),
            password: "pw".into(),
        };
        let text = credential_file(
            ResourceKind::PostgresDatabase,
            &provides(ResourceKind::PostgresDatabase),
            "app-main",
            &c,
            3,
        );
        assert_eq!(
            text,
            "PGHOST=10.202.7.2\nPGPORT=5433\nPGDATABASE=app-main\nPGUSER=app-main\n\
             PGPASSWORD=pw\nDATABASE_URL=postgres://app-main:pw@10.202.7.2:5433/app-main\n\
             MESH_CREDENTIAL_VERSION=3\n"
        );
        for kind in ResourceKind::ALL {
            let text = credential_file(kind, &provides(kind), "app-x", &c, 1);
            assert!(
                text.lines()
                    .any(|l| l == format!("{}=pw", kind.password_key())),
                "{kind}: {text}"
            );
        }
    }
}
