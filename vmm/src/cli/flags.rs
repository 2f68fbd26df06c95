//! The values of the repeated resource flags: `--drive`, `--net` and `--fs`.

use std::path::PathBuf;

use vmm::vmm_config::{
    ConfigError, DriveConfig, FsCache, FsConfig, NetworkInterfaceConfig, Validate,
};

/// Parses `--drive PATH[,readonly][,id=NAME]`; `index` names drives without an ID.
pub fn parse_drive_flag(value: &str, index: usize) -> Result<DriveConfig, ConfigError> {
    let mut parts = value.split(',');
    let path = parts
        .next()
        .filter(|p| !p.is_empty())
        .ok_or_else(|| ConfigError::DriveFlag(value.into()))?;
    let mut drive = DriveConfig::new(format!("drive{index}"), path);
    for part in parts {
        match part.split_once('=') {
            None if part == "readonly" || part == "ro" => drive.is_read_only = true,
            None if part == "root" => drive.is_root_device = true,
            Some(("id", id)) => drive.drive_id = id.to_string(),
            _ => return Err(ConfigError::DriveFlag(value.into())),
        }
    }
    drive.validate()?;
    Ok(drive)
}

/// Parses `--net TAP[,mac=MAC][,id=NAME]`; `index` names interfaces without an ID.
pub fn parse_net_flag(value: &str, index: usize) -> Result<NetworkInterfaceConfig, ConfigError> {
    let mut parts = value.split(',');
    let tap = parts
        .next()
        .filter(|p| !p.is_empty())
        .ok_or_else(|| ConfigError::NetFlag(value.into()))?;
    let mut iface = NetworkInterfaceConfig {
        iface_id: format!("eth{index}"),
        host_dev_name: tap.into(),
        guest_mac: None,
        rx_rate_limiter: None,
        tx_rate_limiter: None,
    };
    for part in parts {
        match part.split_once('=') {
            Some(("mac", mac)) => iface.guest_mac = Some(mac.into()),
            Some(("id", id)) => iface.iface_id = id.into(),
            _ => return Err(ConfigError::NetFlag(value.into())),
        }
    }
    iface.validate()?;
    Ok(iface)
}

/// Parses `--fs TAG=HOST_DIR[,readonly][,cache=auto|always|never][,socket=PATH]`.
pub fn parse_fs_flag(value: &str) -> Result<FsConfig, ConfigError> {
    let bad = || ConfigError::FsFlag(value.into());
    let mut parts = value.split(',');
    let (tag, dir) = parts
        .next()
        .and_then(|first| first.split_once('='))
        .filter(|(_, dir)| !dir.is_empty())
        .ok_or_else(bad)?;
    let mut fs = FsConfig {
        tag: tag.to_string(),
        shared_dir: PathBuf::from(dir),
        readonly: false,
        cache: FsCache::Auto,
        socket: None,
    };
    for part in parts {
        match part.split_once('=') {
            None if part == "readonly" || part == "ro" => fs.readonly = true,
            Some(("cache", "auto")) => fs.cache = FsCache::Auto,
            Some(("cache", "always")) => fs.cache = FsCache::Always,
            Some(("cache", "never")) => fs.cache = FsCache::Never,
            Some(("socket", path)) if !path.is_empty() => fs.socket = Some(PathBuf::from(path)),
            _ => return Err(bad()),
        }
    }
    Ok(fs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmm::vmm_config::{parse_mac, ConfigFile, VmResources};

    #[test]
    fn drive_flags() {
        let d = parse_drive_flag("/x.img,readonly,id=data", 0).expect("parse");
        assert!(d.is_read_only);
        assert_eq!(d.drive_id, "data");
        assert_eq!(
            parse_drive_flag("/y.img", 3).expect("parse").drive_id,
            "drive3"
        );
        assert!(parse_drive_flag("/y.img,bogus", 0).is_err());
        assert!(parse_drive_flag("", 0).is_err());
    }

    #[test]
    fn network_interfaces() {
        let file: ConfigFile = serde_json::from_str(
            r#"{"network-interfaces":[{"iface_id":"eth0","host_dev_name":"tap0","guest_mac":"06:00:AC:10:00:02"}]}"#,
        )
        .expect("parse");
        let mut res = VmResources::default();
        res.apply_file(file, 1024).expect("apply");
        assert_eq!(res.net.len(), 1);
        assert_eq!(parse_mac("06:00:AC:10:00:02"), Ok([6, 0, 0xac, 0x10, 0, 2]));
        for bad in [
            "01:00:00:00:00:01",
            "06:00:ac:10:00",
            "06:00:ac:10:00:02:03",
            "zz:00:00:00:00:01",
            "00:00:00:00:00:00",
        ] {
            assert_eq!(parse_mac(bad), Err(ConfigError::GuestMac(bad.into())));
        }
        let clash = res.upsert_net(parse_net_flag("tap0,id=eth1", 1).expect("flag"));
        assert!(
            matches!(
                clash,
                Err(ConfigError::NetClash {
                    what: "host_dev_name",
                    ..
                })
            ),
            "{clash:?}"
        );
        let clash = res.upsert_net(parse_net_flag("tap1,mac=06:00:ac:10:00:02", 1).expect("flag"));
        assert!(
            matches!(
                clash,
                Err(ConfigError::NetClash {
                    what: "guest_mac",
                    ..
                })
            ),
            "{clash:?}"
        );
        res.upsert_net(parse_net_flag("tap1,mac=06:00:ac:10:00:03", 1).expect("flag"))
            .expect("second interface");
        // Replacing an interface by ID is not a clash with itself.
        res.upsert_net(parse_net_flag("tap0,id=eth0", 0).expect("flag"))
            .expect("replace");
        assert_eq!(res.net.len(), 2);
        assert!(matches!(
            parse_net_flag("tap-name-too-long-x", 0),
            Err(ConfigError::HostDevName(_))
        ));
        assert!(matches!(
            parse_net_flag("tap0,bogus", 0),
            Err(ConfigError::NetFlag(_))
        ));
        let limited: NetworkInterfaceConfig = serde_json::from_str(
            r#"{"iface_id":"eth0","host_dev_name":"tap0","rx_rate_limiter":{}}"#,
        )
        .expect("parse");
        assert_eq!(
            limited.validate(),
            Err(ConfigError::Unsupported("rx_rate_limiter"))
        );
    }

    #[test]
    fn fs_flags_and_checks() {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path().display();
        let fs = parse_fs_flag(&format!("data={d},readonly,cache=never")).expect("parse");
        assert_eq!(fs.tag, "data");
        assert!(fs.readonly);
        assert_eq!(fs.cache, FsCache::Never);
        assert!(parse_fs_flag("data").is_err());
        assert!(parse_fs_flag("data=").is_err());
        assert!(parse_fs_flag(&format!("data={d},cache=sometimes")).is_err());

        let mut res = VmResources {
            virtiofsd: Some(PathBuf::from("/bin/true")),
            ..Default::default()
        };
        res.add_fs(fs.clone()).expect("add");
        assert_eq!(
            res.add_fs(fs.clone()),
            Err(ConfigError::FsTagClash("data".into()))
        );
        let long = FsConfig {
            tag: "x".repeat(37),
            ..fs.clone()
        };
        assert!(matches!(res.add_fs(long), Err(ConfigError::FsTag(_))));
        let empty = FsConfig {
            tag: String::new(),
            ..fs.clone()
        };
        assert!(matches!(res.add_fs(empty), Err(ConfigError::FsTag(_))));
        let missing = FsConfig {
            tag: "m".into(),
            shared_dir: dir.path().join("absent"),
            ..fs.clone()
        };
        let err = res.add_fs(missing).expect_err("missing dir");
        assert!(err.to_string().contains("absent"), "{err}");
        let no_daemon = FsConfig {
            tag: "n".into(),
            ..fs.clone()
        };
        res.virtiofsd = Some(dir.path().join("no-virtiofsd"));
        let err = res.add_fs(no_daemon).expect_err("no virtiofsd");
        assert!(err.to_string().contains("scripts/virtiofsd.sh"), "{err}");
        assert_eq!(res.fs.len(), 1);

        // A caller's virtiofsd: its directory need not be visible here, its socket must exist.
        let socket = dir.path().join("fs.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&socket).expect("bind");
        let absent = dir.path().join("absent");
        let served = parse_fs_flag(&format!(
            "s={},socket={}",
            absent.display(),
            socket.display()
        ))
        .expect("parse");
        assert_eq!(served.socket.as_deref(), Some(socket.as_path()));
        res.add_fs(served)
            .expect("a socket's volume, its directory unseen");
        let gone = parse_fs_flag(&format!("g={d},socket={d}/gone.sock")).expect("parse");
        assert!(matches!(
            res.add_fs(gone),
            Err(ConfigError::FsSocket { .. })
        ));
        assert_eq!(res.fs.len(), 2);
    }

    #[test]
    fn root_device_goes_first() {
        let mut res = VmResources::default();
        res.upsert_drive(parse_drive_flag("/a", 0).expect("a"))
            .expect("a");
        res.upsert_drive(parse_drive_flag("/b,root", 1).expect("b"))
            .expect("b");
        assert_eq!(res.drives[0].drive_id, "drive1");
        assert!(res
            .upsert_drive(parse_drive_flag("/c,root", 2).expect("c"))
            .is_err());
    }
}
