//! Device meshes: the world's ranks laid out on named axes, with one process group per axis.
//!
//! Rank order is row-major over the axes as given, the last axis varying fastest. For the
//! standard layout ([`ParallelDims`]) the axes are `pp, dp, sp, tp`: tensor-parallel groups
//! are runs of consecutive ranks (on one node, where links are fastest) and pipeline stages are
//! the slowest-varying, as in Megatron-Core and torchtitan.
use crate::dist::group::ProcessGroup;
use crate::error::ensure;
use crate::Result;

/// Ranks laid out on named axes, with this rank's group along each axis.
#[derive(Debug)]
pub struct DeviceMesh {
    names: Vec<String>,
    sizes: Vec<usize>,
    coords: Vec<usize>,
    groups: Vec<ProcessGroup>,
}

impl DeviceMesh {
    /// Builds the groups of every axis. Every rank of `world` must call this with the same
    /// axes. The product of the sizes must equal the world size.
    pub fn new(world: &ProcessGroup, axes: &[(&str, usize)]) -> Result<DeviceMesh> {
        let sizes: Vec<usize> = axes.iter().map(|a| a.1).collect();
        let names: Vec<String> = axes.iter().map(|a| a.0.to_string()).collect();
        ensure!(sizes.iter().all(|&s| s >= 1), "mesh axes must have size at least 1, got {}", describe(&names, &sizes));
        let total: usize = sizes.iter().product();
        ensure!(
            total == world.size(),
            "mesh {} has {total} ranks but the world has {}",
            describe(&names, &sizes),
            world.size()
        );
        let coords = coords_of(world.rank(), &sizes);
        let mut groups = Vec::with_capacity(sizes.len());
        for axis in 0..sizes.len() {
            let mut mine = None;
            // Every line along `axis`: fix the other coordinates, vary this one.
            for line in 0..total / sizes[axis] {
                let mut base = coords_of_excluding(line, &sizes, axis);
                let members: Vec<usize> = (0..sizes[axis])
                    .map(|i| {
                        base[axis] = i;
                        rank_of(&base, &sizes)
                    })
                    .collect();
                let name = format!("{}{line}", names[axis]);
                if let Some(g) = world.subgroup(&members, &name)? {
                    mine = Some(g);
                }
            }
            groups.push(mine.expect("every rank lies on one line of each axis"));
        }
        Ok(DeviceMesh { names, sizes, coords, groups })
    }

    /// The group along the named axis.
    pub fn group(&self, axis: &str) -> Option<&ProcessGroup> {
        self.index(axis).map(|i| &self.groups[i])
    }

    /// This rank's coordinate along the named axis.
    pub fn coord(&self, axis: &str) -> Option<usize> {
        self.index(axis).map(|i| self.coords[i])
    }

    /// Size of the named axis.
    pub fn size(&self, axis: &str) -> Option<usize> {
        self.index(axis).map(|i| self.sizes[i])
    }

    fn index(&self, axis: &str) -> Option<usize> {
        self.names.iter().position(|n| n == axis)
    }
}

fn describe(names: &[String], sizes: &[usize]) -> String {
    names.iter().zip(sizes).map(|(n, s)| format!("{n}={s}")).collect::<Vec<_>>().join(" x ")
}

/// Row-major coordinates of `rank`, the last axis fastest.
pub fn coords_of(mut rank: usize, sizes: &[usize]) -> Vec<usize> {
    let mut c = vec![0; sizes.len()];
    for (i, &s) in sizes.iter().enumerate().rev() {
        c[i] = rank % s;
        rank /= s;
    }
    c
}

/// The rank at row-major coordinates.
pub fn rank_of(coords: &[usize], sizes: &[usize]) -> usize {
    coords.iter().zip(sizes).fold(0, |acc, (c, s)| acc * s + c)
}

/// Coordinates of the `line`-th combination of every axis but `skip` (whose coordinate is 0).
fn coords_of_excluding(line: usize, sizes: &[usize], skip: usize) -> Vec<usize> {
    let others: Vec<usize> = sizes.iter().enumerate().filter(|(i, _)| *i != skip).map(|(_, &s)| s).collect();
    let mut c = coords_of(line, &others);
    c.insert(skip, 0);
    c
}

/// The standard layout: pipeline x data x sequence x tensor parallel sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParallelDims {
    /// Pipeline stages.
    pub pp: usize,
    /// Data-parallel replicas.
    pub dp: usize,
    /// Sequence-parallel ranks.
    pub sp: usize,
    /// Tensor-parallel ranks.
    pub tp: usize,
}

impl ParallelDims {
    /// Checks that the sizes are positive and multiply to `world_size`; the error names the
    /// sizes and the world size.
    pub fn validate(&self, world_size: usize) -> Result<()> {
        let ParallelDims { pp, dp, sp, tp } = *self;
        ensure!(
            pp >= 1 && dp >= 1 && sp >= 1 && tp >= 1,
            "parallel sizes must be at least 1: pp={pp} dp={dp} sp={sp} tp={tp}"
        );
        ensure!(
            pp * dp * sp * tp == world_size,
            "pp={pp} x dp={dp} x sp={sp} x tp={tp} = {} ranks, but the job has {world_size}",
            pp * dp * sp * tp
        );
        Ok(())
    }

    /// Validates and builds the mesh with axes `pp`, `dp`, `sp`, `tp`.
    pub fn build(&self, world: &ProcessGroup) -> Result<DeviceMesh> {
        self.validate(world.size())?;
        DeviceMesh::new(world, &[("pp", self.pp), ("dp", self.dp), ("sp", self.sp), ("tp", self.tp)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coordinates_round_trip_row_major() {
        let sizes = [2, 3, 2];
        for r in 0..12 {
            assert_eq!(rank_of(&coords_of(r, &sizes), &sizes), r);
        }
        assert_eq!(coords_of(1, &sizes), vec![0, 0, 1]);
        assert_eq!(coords_of(6, &sizes), vec![1, 0, 0]);
    }

    #[test]
    fn lines_along_an_axis() {
        let sizes = [2, 2];
        let line = |l, axis| {
            let mut b = coords_of_excluding(l, &sizes, axis);
            (0..2)
                .map(|i| {
                    b[axis] = i;
                    rank_of(&b, &sizes)
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(line(0, 1), vec![0, 1]);
        assert_eq!(line(1, 1), vec![2, 3]);
        assert_eq!(line(0, 0), vec![0, 2]);
        assert_eq!(line(1, 0), vec![1, 3]);
    }

    #[test]
    fn parallel_dims_must_match_the_world() {
        let d = ParallelDims { pp: 1, dp: 2, sp: 1, tp: 2 };
        assert!(d.validate(4).is_ok());
        let err = d.validate(8).unwrap_err().to_string();
        assert!(err.contains("= 4 ranks, but the job has 8"), "{err}");
        let err = ParallelDims { pp: 0, dp: 1, sp: 1, tp: 1 }.validate(1).unwrap_err().to_string();
        assert!(err.contains("at least 1"), "{err}");
    }
}
