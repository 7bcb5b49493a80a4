//! The glibc a shared object needs: the highest `GLIBC_x.y` among its version requirements
//! (`.gnu.version_r`), read straight from the ELF file. Used by `expseg doctor` and the
//! portable-build check.

const SHT_GNU_VERNEED: u32 = 0x6fff_fffe;

fn u16_at(b: &[u8], o: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(o..o + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], o: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(o..o + 4)?.try_into().ok()?))
}

fn u64_at(b: &[u8], o: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(o..o + 8)?.try_into().ok()?))
}

fn c_str(b: &[u8], o: usize) -> Option<&str> {
    let s = b.get(o..)?;
    let end = s.iter().position(|c| *c == 0)?;
    std::str::from_utf8(&s[..end]).ok()
}

/// A version such as "2.28" as comparable numbers.
pub fn parse_version(v: &str) -> Vec<u32> {
    v.split('.').map(|p| p.parse().unwrap_or(0)).collect()
}

/// Every version a 64-bit little-endian ELF file requires (`GLIBC_2.28`, ...).
pub fn required_versions(elf: &[u8]) -> Result<Vec<String>, &'static str> {
    if elf.get(0..4) != Some(b"\x7fELF") || elf.get(4) != Some(&2) || elf.get(5) != Some(&1) {
        return Err("not a 64-bit little-endian ELF file");
    }
    let bad = "malformed ELF file";
    let shoff = u64_at(elf, 0x28).ok_or(bad)? as usize;
    let shentsize = u16_at(elf, 0x3a).ok_or(bad)? as usize;
    let shnum = u16_at(elf, 0x3c).ok_or(bad)? as usize;
    let section = |i: usize| shoff + i * shentsize;
    let mut out = Vec::new();
    for i in 0..shnum {
        let s = section(i);
        if u32_at(elf, s + 4).ok_or(bad)? != SHT_GNU_VERNEED {
            continue;
        }
        let off = u64_at(elf, s + 0x18).ok_or(bad)? as usize;
        let link = u32_at(elf, s + 0x28).ok_or(bad)? as usize;
        let strtab = u64_at(elf, section(link) + 0x18).ok_or(bad)? as usize;
        let mut vn = off;
        loop {
            let cnt = u16_at(elf, vn + 2).ok_or(bad)? as usize;
            let mut aux = vn + u32_at(elf, vn + 8).ok_or(bad)? as usize;
            for _ in 0..cnt {
                let name = u32_at(elf, aux + 8).ok_or(bad)? as usize;
                out.push(c_str(elf, strtab + name).ok_or(bad)?.to_string());
                let next = u32_at(elf, aux + 12).ok_or(bad)? as usize;
                if next == 0 {
                    break;
                }
                aux += next;
            }
            let next = u32_at(elf, vn + 12).ok_or(bad)? as usize;
            if next == 0 {
                break;
            }
            vn += next;
        }
    }
    Ok(out)
}

/// The highest glibc version `elf` requires, such as "2.28"; `None` if it requires none.
pub fn glibc_requirement(elf: &[u8]) -> Result<Option<String>, &'static str> {
    Ok(required_versions(elf)?
        .into_iter()
        .filter_map(|v| v.strip_prefix("GLIBC_").map(str::to_string))
        .filter(|v| v.chars().next().is_some_and(|c| c.is_ascii_digit()))
        .max_by_key(|v| parse_version(v)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_glibc_requirement_of_a_real_binary() {
        let me = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        let v = glibc_requirement(&me)
            .unwrap()
            .expect("a Rust test binary needs glibc");
        assert!(parse_version(&v) >= vec![2, 2], "{v}");
        assert!(required_versions(&me)
            .unwrap()
            .iter()
            .any(|s| s.starts_with("GLIBC_")));
    }

    #[test]
    fn rejects_what_is_not_elf() {
        assert!(glibc_requirement(b"#!/bin/sh\n").is_err());
        assert!(glibc_requirement(&[0x7f, b'E', b'L', b'F', 2, 1, 0]).is_err());
        assert!(parse_version("2.28") > parse_version("2.9"));
    }
}
